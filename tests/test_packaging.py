"""A plain (non-editable) install works: the wheel carries the demo model as package data, and
``vlmserve caption`` run from a fresh venv with that wheel captions the README's picture."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "vlmserve" / "assets" / "demo-gemma4"
CAPTION = "A red circle, a blue triangle and a yellow star."  # the README's first command prints it


def _run(*cmd: str | Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"VLMSERVE_NO_OPENBLAS": "1"}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{cmd}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built as ``python -m build`` does, sdist first and the wheel from it, from a copy of the
    sources: nothing is written into the repo and no stale build/ directory leaks in."""
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    shutil.copytree(ROOT / "vlmserve", src / "vlmserve", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    hook = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    sdist = tmp / "dist" / _run(sys.executable, "-c", hook, tmp / "dist", cwd=src).strip().splitlines()[-1]
    _run(sys.executable, "-m", "pip", "wheel", sdist, "--no-deps", "--no-build-isolation", "--no-index",
         "-w", tmp / "dist", cwd=tmp)
    (built,) = (tmp / "dist").glob("vlmserve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; a .pth line borrows this venv's site-packages for
    mlx and the other dependencies (a plain path: its .pth files, the editable finder among
    them, are not run)."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent)
    python = path / "bin" / "python"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=path).strip())
    (purelib / "borrowed-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel, cwd=path)
    return path


def test_the_wheel_carries_the_demo_model(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        sizes = {i.filename: i.file_size for i in zf.infolist()}
    assert sizes["vlmserve/assets/demo-gemma4/model.safetensors"] == (MODEL / "model.safetensors").stat().st_size
    assert {f"vlmserve/assets/demo-gemma4/{p.name}" for p in MODEL.iterdir()} <= sizes.keys()


def test_the_venv_imports_the_wheel_not_the_source_tree(venv: Path, tmp_path: Path) -> None:
    probe = "import vlmserve, vlmserve.config as c; print(vlmserve.__file__); print(c.default_model_path())"
    package, model = _run(venv / "bin" / "python", "-c", probe, cwd=tmp_path).split()
    assert Path(package).is_relative_to(venv) and Path(model).is_relative_to(venv)
    assert (Path(model) / "model.safetensors").is_file()


def test_caption_from_the_wheel_install(venv: Path, tmp_path: Path) -> None:
    out = _run(venv / "bin" / "vlmserve", "caption", ROOT / "assets" / "example.png", cwd=tmp_path)
    assert out.strip() == CAPTION

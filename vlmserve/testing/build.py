"""[any] Build an offline model directory once, atomically, into a cache tests and benchmarks share.

A build runs in a private temp directory next to its destination and is renamed into place
whole, so a concurrent reader (another pytest-xdist worker, a benchmark) sees either nothing or a
complete model. A cache hit imports neither mlx nor transformers.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .recipe import Recipe

# One module per architecture in this package, named after mlx-vlm's model_type.
ARCHS = (
    "gemma4", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5",
    "mistral3", "pixtral", "smolvlm", "paligemma", "llava", "llava_next", "lfm2_vl",
    "glm4v", "glm4v_moe", "llama4", "kimi_vl", "qwen3_vl_moe", "qwen3_5_moe", "internvl_chat",
)  # fmt: skip
SIZES = ("micro", "small")
# Builds of an architecture with the real checkpoints' optional features on, which its tests also run: Gemma 4's
# E2B/E4B (the last layers read earlier layers' KV, per-layer inputs, double-wide MLPs) and 26B-A4B (a
# mixture-of-experts block, keys as values on full-attention layers); InternVL3's beside InternVL3.5's (a Qwen2.5:
# q/k/v biases, no q/k norms).
VARIANTS: dict[str, tuple[str, ...]] = {"gemma4": ("e2b", "moe", "audio"), "internvl_chat": ("internvl3",)}
# Every build the family tests run: each architecture, then each variant as ``arch/variant``.
FAMILY_BUILDS = (*ARCHS, *(f"{arch}/{variant}" for arch, names in VARIANTS.items() for variant in names))
# Bump when anything that shapes the files changes: the cache key includes it.
BUILDER_VERSION = 5  # 5: Qwen2/2.5-VL write their video processor's settings where mlx-vlm reads them
MARKER = "vlmserve_build.json"  # written last inside the build; names what was built
STAGES = ("tokenizer", "processor", "weights", "save")


@dataclass(frozen=True, slots=True)
class BuildKey:
    arch: str
    size: str
    seed: int
    ignore_eos: bool
    quant_bits: int = 0  # 0: float weights; 4 or 8: quantized by mlx-vlm's own convert
    tools: bool = False  # tuned to answer one tool round trip (tool_tuning.py)
    variant: str = ""  # one of VARIANTS[arch]; "": the architecture's plain build
    builder_version: int = BUILDER_VERSION
    # the tokenizer is trained on this interpreter's stdlib sources
    python: str = f"{sys.version_info.major}.{sys.version_info.minor}"

    def record(self) -> dict[str, Any]:
        """The key as the marker file keeps it; a field at its default that older builds lack is left
        out, so their cached builds still match."""
        record = asdict(self)
        if not self.variant:
            del record["variant"]
        return record

    @property
    def dirname(self) -> str:
        eos = "-ignore_eos" if self.ignore_eos else ""
        quant = f"-q{self.quant_bits}" if self.quant_bits else ""
        tools = "-tools" if self.tools else ""
        variant = f"-{self.variant}" if self.variant else ""
        version = f"v{self.builder_version}-py{self.python}"
        return f"{self.arch}-{self.size}-seed{self.seed}{eos}{quant}{tools}{variant}-{version}"


def model_cache_dir() -> Path:
    """``$VLMSERVE_MODEL_CACHE``, else ``~/.cache/vlmserve/models``."""
    env = os.environ.get("VLMSERVE_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vlmserve" / "models"


def build_model(
    arch: str = "gemma4",
    size: str = "micro",
    *,
    out: str | Path | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    quant_bits: int = 0,
    tools: bool = False,
    variant: str = "",
    force: bool = False,
) -> Path:
    """Return a directory ``mlx_vlm.load`` can load, building it unless it is already complete.

    ``out=None`` uses the shared cache; ``ignore_eos=True`` zeroes the special tokens' output
    rows so every request runs to max_tokens (for benchmarks, see weights.silence_tokens);
    ``quant_bits=4`` quantizes the language model as ``mlx_vlm.convert -q`` does (group 64);
    ``tools=True`` fine-tunes the model to answer one tool round trip in its family's syntax;
    ``variant`` (one of ``VARIANTS[arch]``) turns on the real checkpoints' optional features.
    """
    if quant_bits not in (0, 4, 8):
        raise ValueError(f"quant_bits must be 0, 4 or 8, not {quant_bits}")
    if quant_bits and tools:
        raise ValueError("a model is either quantized or tuned for tools, not both")
    if variant and (quant_bits or tools):
        raise ValueError("a variant is a float build's")
    key = BuildKey(_checked(arch, ARCHS, "arch"), _checked(size, SIZES, "size"), seed, ignore_eos, quant_bits, tools,
                   variant and _checked(variant, VARIANTS.get(arch, ()), "variant"))
    dest = Path(out) if out is not None else model_cache_dir() / key.dirname
    if not force and is_complete(dest, key):
        return dest
    replace = force or out is not None  # a cache entry is only ever replaced on request
    if replace:
        check_replaceable(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
    try:
        if quant_bits:
            _write_quantized(key, tmp)
        elif tools:
            _write_tuned(key, tmp)
        else:
            write_model(key, tmp)
        return publish(tmp, dest, key, replace=replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checked(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of: {', '.join(allowed)}")
    return value


def is_complete(path: Path, key: BuildKey) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("key") == key.record()


def publish(tmp: Path, dest: Path, key: BuildKey, *, replace: bool) -> Path:
    """Rename the finished build into place; if another builder won the race, keep theirs."""
    if replace:
        remove_build(dest)
    try:
        os.rename(tmp, dest)
    except OSError:
        if not is_complete(dest, key):
            raise  # something that is not our model occupies dest
    return dest


def check_replaceable(path: Path) -> None:
    """Only an earlier build or an empty directory may be replaced: never a user's files."""
    if path.exists() and not (path / MARKER).exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty and holds no vlmserve build; not replacing it")


def remove_build(path: Path) -> None:
    if not path.exists():
        return
    check_replaceable(path)
    trash = path.with_name(f".{path.name}.{os.getpid()}.old")
    os.rename(path, trash)  # gone from its name in one step, then deleted at leisure
    shutil.rmtree(trash, ignore_errors=True)


def write_model(key: BuildKey, path: Path) -> None:
    """Write tokenizer, processor, config and weights into ``path``, with a progress bar."""
    from vlmserve.progress import progress

    start = time.perf_counter()
    recipe = load_recipe(key.arch, key.size, key.variant)
    with progress(STAGES, desc=f"building {key.arch}/{key.size}", file=sys.stderr, leave=False) as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = _build_tokenizer(recipe)
        bar.update(1)
        bar.set_postfix_str("processor")
        processor = recipe.make_processor(tokenizer)
        bar.update(1)
        bar.set_postfix_str("weights")
        tensors = _make_weights(recipe, key)
        bar.update(1)
        bar.set_postfix_str("save")
        info = _save(recipe, processor, tensors, path)
        bar.update(1)
    info["build_seconds"] = round(time.perf_counter() - start, 3)
    _write_json(path / MARKER, {"key": key.record(), **info})


def _write_quantized(key: BuildKey, path: Path) -> None:
    """The float build, then mlx-vlm's own converter: vision tower and projector stay float."""
    import contextlib
    import dataclasses

    from mlx_vlm.convert import convert

    start = time.perf_counter()
    source = build_model(key.arch, key.size, seed=key.seed, ignore_eos=key.ignore_eos)
    with contextlib.redirect_stdout(sys.stderr):  # its [INFO] lines are progress, not output
        convert(str(source), mlx_path=str(path), quantize=True, q_bits=key.quant_bits, q_group_size=64)
    (path / "README.md").unlink(missing_ok=True)
    info = json.loads((source / MARKER).read_text())
    info |= {"key": key.record(), "quantized_from": dataclasses.replace(key, quant_bits=0).record(),
             "build_seconds": round(time.perf_counter() - start, 3)}
    _write_json(path / MARKER, info)


def _write_tuned(key: BuildKey, path: Path) -> None:
    """The float build, loaded as the server loads it, fine-tuned on one tool round trip."""
    import dataclasses

    from mlx_vlm.utils import load

    from .tool_tuning import tune
    from .weights import save_weights, weight_tensors

    start = time.perf_counter()
    source = build_model(key.arch, key.size, seed=key.seed, ignore_eos=key.ignore_eos)
    shutil.copytree(source, path, dirs_exist_ok=True)
    recipe = load_recipe(key.arch, key.size)
    model, processor = load(str(source))
    steps = tune(model, processor, frozenset(recipe.eos_ids), key.seed)
    save_weights(weight_tensors(model, recipe.dims.dtype, skip=recipe.skip_weights), path / "model.safetensors")
    info = json.loads((source / MARKER).read_text())
    info |= {"key": key.record(), "tuned_from": dataclasses.replace(key, tools=False).record(),
             "tuning_steps": steps, "build_seconds": round(time.perf_counter() - start, 3)}
    _write_json(path / MARKER, info)


def load_recipe(arch: str, size: str, variant: str = "") -> Recipe:
    # imported here: the arch modules import mlx, which a cache hit must not pay for
    module = importlib.import_module(f"{__package__}.{arch}")
    if variant:
        return module.recipe(size, variant)
    return module.recipe(size)


def build_family(name: str, size: str = "micro", **options: Any) -> Path:
    """``build_model`` for one of ``FAMILY_BUILDS``: an architecture, or ``arch/variant``."""
    arch, _, variant = name.partition("/")
    return build_model(arch, size, variant=variant, **options)


def _build_tokenizer(recipe: Recipe) -> Any:
    from .tokenizer import build_tokenizer

    return build_tokenizer(recipe.tokens)


def _make_weights(recipe: Recipe, key: BuildKey) -> dict[str, Any]:
    from .weights import instantiate, silence_tokens, weight_tensors

    model = instantiate(recipe.config, key.seed)
    recipe.fix_init(model)
    if key.ignore_eos:
        silence_tokens(model, range(len(recipe.tokens.special_tokens)), recipe.tied_embeddings)
    return weight_tensors(model, recipe.dims.dtype, skip=recipe.skip_weights)


def _save(recipe: Recipe, processor: Any, tensors: dict[str, Any], path: Path) -> dict[str, Any]:
    from .weights import count_params, save_weights

    processor.save_pretrained(str(path))
    _write_json(path / "config.json", recipe.config)
    generation = {"bos_token_id": recipe.config["bos_token_id"], "eos_token_id": recipe.eos_ids}
    _write_json(path / "generation_config.json", generation)
    save_weights(tensors, path / "model.safetensors")
    return {"parameters": count_params(tensors), "dtype": recipe.dims.dtype}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")

"""[main] Find OpenBLAS and restart a command under it: float32 matmuls on Linux CPUs.

The ``mlx[cpu]`` wheel for Linux links a reference BLAS: float32 matmuls run at ~5 GFLOP/s on
our 2-core machine, 140-170 with OpenBLAS preloaded (bfloat16 ones use MLX's own kernels,
~4.6, either way). ``train-demo``, ``serve`` and ``caption`` restart themselves once with
``LD_PRELOAD`` when the library is installed (Debian/Ubuntu: ``apt-get install
libopenblas0-pthread``), and then serve float32 weights (``--dtype auto``). macOS has Accelerate.
"""

from __future__ import annotations

import glob
import os
import sys

OPENBLAS_PATTERNS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
    "/usr/lib/libopenblas.so.0",
)
OPT_OUT = "VLMSERVE_NO_OPENBLAS"  # set to run with whatever BLAS the wheel links


def find_openblas() -> str | None:
    """The first OpenBLAS shared library installed on this machine, or None."""
    for pattern in OPENBLAS_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def openblas_preloaded() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def reexec_with_openblas(argv: list[str]) -> None:
    """On Linux, replace this process by ``python -m vlmserve ARGV`` with OpenBLAS preloaded.

    Returns (and the command runs as it is) on other systems, when it is already preloaded, when
    none is installed, or when ``VLMSERVE_NO_OPENBLAS`` is set.
    """
    if not sys.platform.startswith("linux") or openblas_preloaded() or os.environ.get(OPT_OUT):
        return
    library = find_openblas()
    if library is None:
        print(
            "vlmserve: no OpenBLAS found; float32 matmuls run on the wheel's slow reference BLAS "
            "(install libopenblas0-pthread: float32 matmuls ~28x faster, 5 -> 140 GFLOP/s on 2 cores; a gemma4 "
            "image prefill 400 -> 60 ms)",
            file=sys.stderr,
        )
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    print(f"vlmserve: restarting with LD_PRELOAD={library} (fast float32 matmuls)", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "vlmserve", *argv], env)

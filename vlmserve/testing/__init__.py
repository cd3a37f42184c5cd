"""[any] Builders for the small offline vision-language models that tests and benchmarks use.

    from vlmserve.testing import build_model
    path = build_model("gemma4", "micro")   # cached; mlx_vlm.load(str(path)) loads it

Models are random (seeded), in Hugging Face layout with MLX weight names, with a locally trained
BPE tokenizer, the architecture's real processor and a chat template in its real syntax.
"""

from .build import ARCHS, BUILDER_VERSION, FAMILY_BUILDS, SIZES, VARIANTS, build_family, build_model, model_cache_dir

__all__ = ["ARCHS", "BUILDER_VERSION", "FAMILY_BUILDS", "SIZES", "VARIANTS", "build_family", "build_model",
           "model_cache_dir"]

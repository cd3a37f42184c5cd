"""[any] vlmserve: a serving engine for vision-language models on Apple's MLX."""

__version__ = "0.1.0"

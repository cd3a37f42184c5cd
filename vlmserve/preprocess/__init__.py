"""[pool] Phase 1 of the pipeline: chat template, tokenization, image decoding.

Everything here runs on a CPU thread pool and returns lists and numpy arrays, never
``mx.array``: the worker thread turns them into MLX arrays.
"""

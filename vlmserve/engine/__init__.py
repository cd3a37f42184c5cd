"""[worker] The only package that imports MLX: worker thread, runner, scheduler, loading.

Import submodules explicitly; this package itself imports nothing, so that
``vlmserve.engine.params`` stays usable from the event loop without MLX.
"""

"""kvsieve: adaptive sparse attention for long-context decoding (Tactic + LServe)."""
__version__ = "0.1.0"
__all__ = ["sparse_decode", "SparseDecodeResult", "make_method", "METHOD_NAMES", "__version__"]


def __getattr__(name: str):
    """The public API, imported on first use: `python -m kvsieve` and the `kvsieve` command
    load torch inside their Ctrl-C handling (one line, exit 130), not before it."""
    if name in ("sparse_decode", "SparseDecodeResult"):
        from . import api

        return getattr(api, name)
    if name in ("make_method", "METHOD_NAMES"):
        from . import methods

        return getattr(methods, name)
    raise AttributeError(f"module 'kvsieve' has no attribute {name!r}")

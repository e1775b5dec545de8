"""kvsieve: adaptive sparse attention for long-context decoding (Tactic + LServe)."""
from .api import SparseDecodeResult, sparse_decode
from .methods import METHOD_NAMES, make_method

__version__ = "0.1.0"
__all__ = ["sparse_decode", "SparseDecodeResult", "make_method", "METHOD_NAMES", "__version__"]

"""portable_gemm: GEMM and weight-only quantised linear ops for every PyTorch from 2.9 on.

Importing picks the binding compiled for the newest stable-ABI target the installed torch
can run (see `info()`, or `python -m portable_gemm info`), registers its ops under
torch.ops.portable_gemm, and exposes typed wrappers.
"""

import torch  # noqa: F401  (the bindings resolve their symbols against the loaded libtorch)

from . import _loader
from ._namespace import NAMESPACE

_state = _loader.load()

from .ops import dequantize_weight, gemm, mixed_linear, quantize_weight  # noqa: E402
from ._info import info  # noqa: E402

__version__ = _state.manifest.get("project_version", "unknown")
__all__ = ["gemm", "quantize_weight", "mixed_linear", "dequantize_weight", "info", "NAMESPACE"]

"""portable_gemm: GEMM and weight-only quantised linear ops for every PyTorch from 2.9 on.

When torch is imported, this picks the binding compiled for the newest stable-ABI target the
installed torch can run (see `info()` or `python -m portable_gemm info`), registers its ops
under torch.ops.portable_gemm and exposes typed wrappers.

Import torch first (the usual case) and everything is loaded by `import portable_gemm`.
Otherwise loading waits for the first use of a torch-facing name (gemm, info, ...), so that
`import portable_gemm.dlpack` - the torch-free door - never imports torch.
"""

import importlib
import json
import os
import sys
import threading

from ._namespace import NAMESPACE

_OPS = ("gemm", "quantize_weight", "mixed_linear", "dequantize_weight")
_SCRATCH = ("release_cpu_scratch", "cpu_scratch_bytes")
__all__ = [*_OPS, *_SCRATCH, "info", "NAMESPACE"]
_state = None
_ready = False  # _state set and the ops module run
_lock = threading.RLock()


def _load():
    """Import torch, load the matching binding, register the ops (once per process). Threads
    that arrive while another loads wait for it: the ops module must have run to its end
    before anyone reads a wrapper from it."""
    global _state, _ready
    if _ready:
        return _state
    with _lock:
        if _state is None:
            import torch  # noqa: F401  (the bindings resolve their symbols against libtorch)

            from . import _loader

            _state = _loader.load()
            importlib.import_module(f"{__name__}.ops")  # fake kernels and autograd
            _ready = True
    return _state


def _version() -> str:
    """The build manifest's project_version, read without importing torch or loading a
    binary (so it also answers when the loader would refuse, e.g. a bad PORTABLE_GEMM_TARGET)."""
    try:
        with open(os.path.join(os.path.dirname(__file__), "lib", "manifest.json")) as f:
            version = json.load(f).get("project_version")
    except (OSError, ValueError, AttributeError):
        return "unknown"
    return version if isinstance(version, str) else "unknown"


def __getattr__(name):
    if name in _OPS:
        _load()
        value = getattr(sys.modules[f"{__name__}.ops"], name)
    elif name in _SCRATCH:
        _load()
        value = getattr(importlib.import_module(f"{__name__}._scratch"), name)
    elif name == "info":
        _load()
        from ._info import info as value
    elif name == "__version__":
        value = _version()
    elif name == "nn":
        _load()
        value = importlib.import_module(f"{__name__}.nn")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    # the lazily loaded names too (tab completion lists them before their first use)
    return sorted(set(globals()) | set(__all__) | {"nn", "__version__"})


if "torch" in sys.modules:
    _load()

"""The torch-free door: portable_gemm's kernels for NumPy on the CPU, and CuPy, JAX or
torch arrays on CUDA (anything with ``__dlpack__``, or the buffer protocol), without
importing torch.

Same kernel library and validation as the torch ops. On the CPU, threads come from the kernel
library's own pool (``PORTABLE_GEMM_NUM_THREADS`` sets its size, else the hardware
concurrency, or torch's thread count where portable_gemm's torch ops on target 2.9 share
the process). On CUDA, the work is
enqueued on ``stream`` (a cudaStream_t as an int; default 0 = the legacy default stream) on
the inputs' device and the call returns without synchronising: pass your framework's current
stream (``torch.cuda.current_stream().cuda_stream``, ``cupy.cuda.get_current_stream().ptr``)
or synchronise before using the result elsewhere. Results are new arrays of the input's kind
on the inputs' device (NumPy in, NumPy out; CuPy in, CuPy out; torch in, torch out).

bfloat16: NumPy has no bf16 dtype, so bf16 data travels as its uint16 bit patterns with
``bf16_bits=True`` (``x.view(np.uint16)`` of an ``ml_dtypes.bfloat16`` array); results then
come back as uint16 bits too. Producers with a native bf16 DLPack dtype need no flag.

Functions (same semantics as the torch ops; a, b, x, weight are 2-D):
    gemm(a, b, bias=None, activation="none", bf16_bits=False, stream=0, out=None)
    quantize_weight(weight, bits, group_size=None, bf16_bits=False, stream=0) -> (qweight, scales)
    mixed_linear(x, qweight, scales, bits, group_size=None, bias=None, activation="none",
                 bf16_bits=False, stream=0, out=None)

    build_info() -> str      the kernel library's build in one line (version, compiler, CUDA archs)
    cpu_isa() -> str         the CPU units in use ("avx512+bf16", ...; PORTABLE_GEMM_ISA lowers them)
    cpu_avx2_dq() -> str     on the AVX2 kernels, the rows of x where weight-only dequantises each
                             weight row once, and why ("" under other units; info()'s cpu_avx2_dq)
    has_cuda() -> bool       whether this build has the CUDA kernels (not whether a GPU is present)

Memory: the CPU kernels keep per-thread scratch buffers (packed panels, partial sums) for
the next call. ``cpu_scratch_bytes()`` says how many bytes they hold, and
``release_cpu_scratch()`` frees those of every thread not inside a call at that moment and
returns the bytes freed (the same buffers as the torch ops' when both doors share the
package's kernel library; see ``portable_gemm.release_cpu_scratch``).

``out``: write the (M, N) result into this array and return it, instead of allocating a new
one. It must be writable, on the operands' device, of the result's dtype, with unit column
stride (rows may be padded: ``buf[:, :N]`` of a wider buffer) and share no memory with an
operand; a refused ``out`` is left untouched. On CUDA a fresh result costs a cudaMalloc, and
freeing it a device-wide synchronising cudaFree (the door cannot know which streams its
consumer used), which dominates small calls; with ``out`` a call allocates nothing at M <= 64,
and a CUDA graph can capture it.
Autograd: the door runs outside it. A torch tensor that requires grad is refused (as torch's
own ``__dlpack__`` refuses it): use the torch ops, ``portable_gemm.gemm`` and friends, for
gradients. An ``out`` tensor is written without autograd knowing (its version counter does
not move), so never pass one that autograd saved for a backward pass.
Bad input raises TypeError (dtype, kind of array) or ValueError (shapes, arguments, arrays on
different devices); once the arguments are parsed (nanobind's own "incompatible function
arguments" errors aside), the message begins with the function's full name
(``portable_gemm.dlpack.gemm: ...``; a vendored copy's own module name).
"""

import os

from . import _env
from ._namespace import WHO


def _no_door_for_this_python(error: ImportError) -> ImportError:
    """The door is a CPython extension: a cp311 one, or one cp312-abi3 module for 3.12 and
    later. A copy made under one Python and imported under another has a module this one
    cannot take (the torch ops, loaded with ctypes, do not care)."""
    import glob
    import importlib.machinery
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    built = sorted(os.path.basename(f) for f in glob.glob(os.path.join(here, "_dlpack*.so")))
    if not built:
        return error
    this = f"{sys.implementation.name} {sys.version_info.major}.{sys.version_info.minor}"
    return ImportError(f"{WHO}: the DLPack door here is {', '.join(built)}, which {this} cannot import (it takes "
                       f"{' or '.join(importlib.machinery.EXTENSION_SUFFIXES)}); the torch ops work on any Python. "
                       "Install portable_gemm for this Python (the cp312-abi3 wheel serves 3.12 and later), or "
                       "vendor from one installed under it")


try:
    from ._dlpack import (_set_error_prefix, build_info, cpu_avx2_dq, cpu_isa, cpu_scratch_bytes, gemm, has_cuda,
                          mixed_linear, quantize_weight, release_cpu_scratch)
except ModuleNotFoundError as e:
    if e.name != f"{__package__}._dlpack":
        raise
    raise _no_door_for_this_python(e) from None

__all__ = ["gemm", "quantize_weight", "mixed_linear", "build_info", "cpu_isa", "cpu_avx2_dq", "has_cuda",
           "cpu_scratch_bytes", "release_cpu_scratch"]

_set_error_prefix(__name__ + ".")  # a vendored copy's errors name the copy
_env.warn_all(_env.problems(os.environ, cpu_isa=cpu_isa()))

"""The torch-free door: portable_gemm's kernels for NumPy (or any CPU array with
``__dlpack__`` / the buffer protocol), without importing torch.

Same kernel library and validation as the torch ops; threads come from the kernel library's
own pool (``PORTABLE_GEMM_NUM_THREADS`` sets its size). Results are new arrays of the input's
kind (NumPy in, NumPy out). CPU arrays only for now: CUDA arrays are refused with a TypeError.

bfloat16: NumPy has no bf16 dtype, so bf16 data travels as its uint16 bit patterns with
``bf16_bits=True`` (``x.view(np.uint16)`` of an ``ml_dtypes.bfloat16`` array); results then
come back as uint16 bits too. Producers with a native bf16 DLPack dtype need no flag.

Functions (same semantics as the torch ops; a, b, x, weight are 2-D):
    gemm(a, b, bias=None, activation="none", bf16_bits=False)
    quantize_weight(weight, bits, group_size=None, bf16_bits=False) -> (qweight, scales)
    mixed_linear(x, qweight, scales, bits, group_size=None, bias=None, activation="none",
                 bf16_bits=False)
Bad input raises TypeError (dtype, kind of array) or ValueError (shapes, arguments).
"""

from ._dlpack import build_info, cpu_isa, gemm, mixed_linear, quantize_weight

__all__ = ["gemm", "quantize_weight", "mixed_linear", "build_info", "cpu_isa"]

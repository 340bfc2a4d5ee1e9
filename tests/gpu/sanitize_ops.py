"""Every CUDA op once, at small odd and aligned shapes, every dtype and scheme: the workload
compute-sanitizer (memcheck / racecheck / initcheck) runs over in ci/gpu_session.sh."""

import os
import sys

# initcheck must see the kernels' own writes: without the tests' output fill, which would
# initialise every fresh output first (the kernel library reads the variable once, at load).
os.environ.pop("PORTABLE_GEMM_FILL_OUTPUTS", None)
import torch  # noqa: E402

import portable_gemm as pg  # noqa: E402
from portable_gemm import dlpack  # noqa: E402

# --initcheck: leave out the calls whose result is read back after a TMA store (cuBLAS's and
# CUTLASS's sm_90 kernels write with cp.async.bulk, which initcheck does not track: every
# such read is reported; bench/GPU_NOTES.md, run 21). ci/gpu_session.sh runs initcheck with
# the sm_90 kernels switched off and this flag.
INITCHECK = "--initcheck" in sys.argv

torch.manual_seed(0)
dev = "cuda"
n_calls = 0
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for m, k, n in ((1, 1, 1), (7, 13, 5), (33, 65, 17), (128, 256, 64)):
        a = torch.randn(m, k, device=dev).to(dtype)
        b = torch.randn(k, n, device=dev).to(dtype)
        bias = torch.randn(n, device=dev).to(dtype)
        pg.gemm(a, b, bias=bias, activation="gelu")
        pg.gemm(a.T.contiguous().T, b.T.contiguous().T)
        n_calls += 2
for bits, group in ((8, None), (8, 32), (4, None), (4, 128)):
    # 24, 48: the small-M GEMV in slices of 16 rows of x (int8: four x tiles, one pass at 24,
    # slices of 32 rows at 48; on sm_90 M = 33..64 takes weights up to 16 MiB); 100, 300: the sm_90
    # GEMM's tiles 128 and 256 rows of x wide (stream-K below 300)
    for m in (1, 5, 16, 24, 48) if INITCHECK else (1, 5, 16, 24, 48, 100, 300):
        w = torch.randn(72, 256, device=dev, dtype=torch.bfloat16)
        q, s = pg.quantize_weight(w, bits=bits, group_size=group)
        for xdtype in (torch.float16, torch.bfloat16):
            x = torch.randn(m, 256, device=dev).to(xdtype)
            pg.mixed_linear(x, q, s, bits=bits, group_size=group, bias=torch.randn(72, device=dev).to(xdtype),
                            activation="silu")
            n_calls += 1
            if m == 5:  # the small-M kernels are compiled per scales dtype
                for sdtype in (torch.float32, torch.float16):
                    pg.mixed_linear(x, q, s.to(sdtype), bits=bits, group_size=group)
                    n_calls += 1
        n_calls += 1
if not INITCHECK:
    # the 256-wide tile under stream-K: M = 129..256 and N > 4096 on the H200
    w = torch.randn(4352, 256, device=dev, dtype=torch.bfloat16)
    q, s = pg.quantize_weight(w, bits=4, group_size=128)
    pg.mixed_linear(torch.randn(200, 256, device=dev, dtype=torch.bfloat16), q, s, bits=4, group_size=128)
    n_calls += 1
# M = 33..64 on a weight above 16 MiB (17 here): g128 takes the sm_90 GEMM's 64-wide tile
# (stream-K) where it is on (memcheck, racecheck) and the small-M GEMV in slices where it is
# off (initcheck); g32, which that GEMM refuses (a group spans whole 64-wide k-blocks), takes
# the GEMV under every tool.
w = torch.randn(264, 131072, device=dev, dtype=torch.bfloat16)
x = torch.randn(48, 131072, device=dev, dtype=torch.bfloat16)
for group in (128, 32):
    q, s = pg.quantize_weight(w, bits=4, group_size=group)
    pg.mixed_linear(x, q, s, bits=4, group_size=group)
    n_calls += 1
# The DLPack door at M > 64 (cuda::mixed_linear_pooled): scratch from the device's pool, the
# sm_90 GEMM (g128 where it is on) or dequantise + the library's gemm (g32; g128 under
# initcheck), with bias and activation.
stream = torch.cuda.current_stream().cuda_stream
w = torch.randn(264, 512, device=dev, dtype=torch.bfloat16)
x = torch.randn(100, 512, device=dev, dtype=torch.bfloat16)
for group in (128, 32):
    q, s = pg.quantize_weight(w, bits=4, group_size=group)
    dlpack.mixed_linear(x, q, s, 4, group_size=group, bias=torch.randn(264, device=dev, dtype=torch.bfloat16),
                        activation="gelu", stream=stream)
    n_calls += 1
# out= into a column slice of a wider buffer (row stride N + 3: the sm_90 GEMMs refuse it) at
# M = 16 (GEMV) and M = 100, and a dense gemm the same way: the kernels' strided stores.
buf = torch.zeros(100, 267, device=dev, dtype=torch.bfloat16)
for m in (16, 100):
    dlpack.mixed_linear(x[:m], q, s, 4, group_size=32, stream=stream, out=buf[:m, :264])
    n_calls += 1
dlpack.gemm(x[:, :256], w[:, :256].T, stream=stream, out=buf[:, :264])
n_calls += 1
torch.cuda.synchronize()
print(f"sanitize_ops: {n_calls} op calls completed on {torch.cuda.get_device_name()}")

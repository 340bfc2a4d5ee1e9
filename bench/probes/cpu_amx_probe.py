# CPU probe (used on the H200 machine's AMX host, bench/CPU_NOTES.md 21): bf16 gemm (ours) vs
# torch.matmul, 2 threads, best of 3 alternating rounds; then mixed_linear int4 g128 / int8 vs
# torch's weight-only kernels and bf16 F.linear at M = 1, 16, 64, 256. One line per case.
# usage: python bench/probes/cpu_amx_probe.py TAG   (PGX_SKIP_WO=1: dense only; PGX_SKIP_DENSE=1;
#        PGX_MS=1,16: the M of the weight-only part; PGX_NS=1024,2048: the dense sizes; PGX_THREADS;
#        PGX_ROTATE=1: weights cycled over copies of > 128 MB, so that they stream from DRAM; PGX_SHAPES=4096x4096;
#        PGX_DENSE_DTYPE=float32: the dense part's dtype (bfloat16); PGX_INT4_ONLY=1; PGX_OURS_ONLY=1: our int4 and int8 only, for A/B between builds or settings)
import os, sys, time
import torch, torch.nn.functional as F
import portable_gemm as pg
torch.set_num_threads(int(os.environ.get("PGX_THREADS", "2")))
tag = sys.argv[1] if len(sys.argv) > 1 else ""
print(tag, "cpu_isa", pg.info()["features"]["cpu_isa"], "threads", torch.get_num_threads(), flush=True)
def t(f, budget=0.25):
    f(); n = 0; t0 = time.perf_counter(); best = 1e9
    while time.perf_counter() - t0 < budget or n < 3:
        a = time.perf_counter(); f(); best = min(best, time.perf_counter() - a); n += 1
    return best
def rounds(fs, r=3):
    res = {k: [] for k in fs}
    for _ in range(r):
        for k, f in fs.items(): res[k].append(t(f))
    return {k: min(v) for k, v in res.items()}
for n in () if os.environ.get("PGX_SKIP_DENSE") else [int(v) for v in os.environ.get("PGX_NS", "256,512,1024,2048,4096").split(",")]:
    dt = getattr(torch, os.environ.get("PGX_DENSE_DTYPE", "bfloat16"))
    a = torch.randn(n, n, dtype=dt); b = torch.randn(n, n, dtype=dt)
    r = rounds({"ours": lambda: pg.gemm(a, b), "torch": lambda: torch.matmul(a, b)})
    fl = 2 * n ** 3
    print(f"{tag} gemm {dt} {n}: ours {fl / r['ours'] / 1e9:.0f} GFLOP/s, torch {fl / r['torch'] / 1e9:.0f}, ratio {r['torch'] / r['ours']:.2f}", flush=True)
if os.environ.get("PGX_SKIP_WO"): sys.exit()
def cycle(*ts):
    """Callable returning the tensors ts, or (PGX_ROTATE) the next of enough copies of them."""
    n = 1 if not os.environ.get("PGX_ROTATE") else -(-(128 << 20) // sum(t.numel() * t.element_size() for t in ts))
    copies = [ts] + [tuple(t.clone() for t in ts) for _ in range(n - 1)]
    it = iter(range(1 << 62))
    return lambda: copies[next(it) % n]
shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("PGX_SHAPES", "4096x4096,4096x12288").split(",")]
for (K, N) in shapes:
    W = torch.randn(N, K, dtype=torch.bfloat16)
    c4 = cycle(*pg.quantize_weight(W, bits=4, group_size=128))
    c8 = cycle(*pg.quantize_weight(W, bits=8))
    ct4 = cycle(torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 8))
    sz = torch.randn(K // 128, N, 2, dtype=torch.bfloat16)
    ct8 = cycle(torch.randint(-128, 127, (N, K), dtype=torch.int8)); s8t = torch.randn(N, dtype=torch.bfloat16)
    cw = cycle(W)
    for m in [int(v) for v in os.environ.get("PGX_MS", "1,16,64,256").split(",")]:
        x = torch.randn(m, K, dtype=torch.bfloat16)
        fs = {"int4": lambda: pg.mixed_linear(x, *c4(), bits=4, group_size=128),
              "t_int4": lambda: torch._weight_int4pack_mm_for_cpu(x, *ct4(), 128, sz),
              "int8": lambda: pg.mixed_linear(x, *c8(), bits=8),
              "t_int8": lambda: torch._weight_int8pack_mm(x, *ct8(), s8t),
              "F.linear": lambda: F.linear(x, *cw())}
        if os.environ.get("PGX_OURS_ONLY"):
            r = rounds({k: fs[k] for k in ("int4", "int8")})
            print(f"{tag} wo {K}x{N} M={m}: int4 {r['int4']*1e3:.3f} ms, int8 {r['int8']*1e3:.3f} ms", flush=True)
            continue
        if os.environ.get("PGX_INT4_ONLY"):  # ours and torch's int4 only
            fs = {k: fs[k] for k in ("int4", "t_int4")}
            r = rounds(fs)
            print(f"{tag} wo {K}x{N} M={m}: int4 {r['int4']*1e3:.3f} ms ({r['t_int4']/r['int4']:.2f}x torch)", flush=True)
            continue
        r = rounds(fs)
        fl = 2 * m * N * K
        print(f"{tag} wo {K}x{N} M={m}: int4 {r['int4']*1e3:.3f} ms ({r['t_int4']/r['int4']:.2f}x torch, {r['F.linear']/r['int4']:.2f}x F.linear), "
              f"int8 {r['int8']*1e3:.3f} ms ({r['t_int8']/r['int8']:.2f}x torch, {r['F.linear']/r['int8']:.2f}x F.linear), "
              f"F.linear {fl / r['F.linear'] / 1e9:.0f} GFLOP/s", flush=True)

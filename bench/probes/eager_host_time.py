# GPU probe of bench/GPU_NOTES.md run 34; usage: python bench/probes/eager_host_time.py LABEL (repository root).
# Eager per-call time of decode-size calls (host-bound at 4096^2): the wrapper's direct call.
import sys, time
sys.path.insert(0, "bench")
import torch
from gpu_bench import event_time_us, copies_for
import portable_gemm as pg
label = sys.argv[1]
torch.manual_seed(0)
for k, n in [(4096, 4096), (8192, 8192)]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, s = pg.quantize_weight(w, bits=4, group_size=128)
    nq = copies_for(q.numel())
    qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(nq - 1)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    f = lambda i=0: pg.mixed_linear(x, *qs[i % nq], bits=4, group_size=128)
    t = event_time_us(f, 200)[0]
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for i in range(2000): f(i)
    host = (time.perf_counter() - t0) / 2000 * 1e6
    torch.cuda.synchronize()
    print(f"{label} K=N={k} int4 g128 M=1: eager {t:6.2f} us/call on the GPU, host {host:6.2f} us/call", flush=True)

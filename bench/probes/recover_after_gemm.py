# GPU probe of bench/GPU_NOTES.md run 33a; run from the repository root on a CUDA machine.
# After a power-heavy GEMM burst, how long until a small-M call is back to its speed?
import sys, time
sys.path.insert(0, "bench")
import torch, torch.nn.functional as F
import portable_gemm as pg
torch.manual_seed(0)
w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.02
q, s = pg.quantize_weight(w, bits=4, group_size=128)
qs = [(q.clone(), s.clone()) for _ in range(8)]
x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
a = torch.randn(4096, 28672, device="cuda", dtype=torch.bfloat16); b = torch.randn(8192, 28672, device="cuda", dtype=torch.bfloat16)
for _ in range(20): pg.mixed_linear(x, *qs[0], bits=4, group_size=128)
for trial in range(2):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        F.linear(a, b); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(301)]
    ev[0].record()
    for j in range(300):
        for i in range(25):
            pg.mixed_linear(x, *qs[i % 8], bits=4, group_size=128)
        ev[j + 1].record()
    torch.cuda.synchronize()
    per = [ev[j].elapsed_time(ev[j + 1]) * 1e3 / 25 for j in range(300)]
    cum = 0.0; out = []
    for j, t in enumerate(per):
        cum += t * 25
        if j in (0, 1, 2, 4, 8, 16, 32, 64, 128, 200, 299):
            out.append(f"{cum / 1e3:6.1f} ms: {t:5.1f} us")
    print(f"trial {trial}: per-call time of 25-call windows after 0.5 s of F.linear M=4096 (28672 x 8192): " + "; ".join(out), flush=True)

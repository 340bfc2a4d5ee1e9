"""Why graph replay is slower than eager at large M (bench/GPU_NOTES.md, run 50b: 11008 x 4096
int4 g128 M = 1024, ours 126.9 us eager / 139.8 replayed, bf16 F.linear 126.8 / 131.6).
Hypothesis: the graph's 20 calls write 20 distinct outputs from its private pool, while an
eager loop hands the same freed block back to every call, so its output stays in L2. Times,
per case: eager (outputs freed), eager with the 20 outputs kept alive (distinct blocks), and
graph replay of 20 calls; 3 alternating rounds, medians of 7 loops. From the repository root
on a CUDA machine with portable_gemm installed:

    python bench/probes/gpu_graph_vs_eager.py
"""
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_bench import copies_for, graph_time_us, warm_up  # noqa: E402

import portable_gemm as pg  # noqa: E402

ITERS = 20


def eager_us(fn, keep: bool) -> float:
    warm_up(fn)
    times = []
    for _ in range(7):
        kept = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(ITERS):
            y = fn(i)
            if keep:
                kept.append(y)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ITERS)
        del kept
    return statistics.median(times)


torch.manual_seed(0)
cases = []
for k, n, m, bits, group in [(11008, 4096, 1024, 4, 128), (28672, 8192, 16, 8, None), (4096, 4096, 1024, 8, 128)]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    nq = copies_for(q.numel() * q.element_size())
    qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(nq - 1)]
    ws = [w] + [w.clone() for _ in range(min(copies_for(w.numel() * 2), 4) - 1)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    name = f"({k}, {n}) M={m} int{bits} g{group or 'ch'}"
    cases.append((name + " ours", lambda i, qs=qs, x=x, b=bits, g=group: pg.mixed_linear(x, *qs[i % len(qs)], bits=b, group_size=g)))
    cases.append((name + " bf16", lambda i, ws=ws, x=x: F.linear(x, ws[i % len(ws)])))
res = {c[0]: {"eager": [], "eager_keep": [], "graph": []} for c in cases}
for r in range(3):
    for label, fn in cases:
        for v in (("eager", "eager_keep", "graph") if r % 2 == 0 else ("graph", "eager_keep", "eager")):
            t = graph_time_us(fn, ITERS) if v == "graph" else eager_us(fn, v == "eager_keep")
            res[label][v].append(t)
    print(f"round {r + 1}/3 done", flush=True)
print(f"{'case':<44} {'eager':>8} {'eager, outputs kept':>20} {'graph':>8}  (us per call, median of 3 rounds)")
for label, d in res.items():
    print(f"{label:<44} {statistics.median(d['eager']):8.1f} {statistics.median(d['eager_keep']):20.1f} "
          f"{statistics.median(d['graph']):8.1f}")

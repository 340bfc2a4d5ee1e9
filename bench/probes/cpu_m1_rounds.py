"""int8 per-channel mixed_linear at M = 1 on three shapes, three rounds, each row set against
a read-bandwidth probe taken right before it (bench/CPU_NOTES.md, section 16). From the
repository root, with portable_gemm installed:

    python bench/probes/cpu_m1_rounds.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_bench import read_bandwidth, rotation, timeit  # noqa: E402

import portable_gemm as pg  # noqa: E402

torch.manual_seed(0)
cases = []
for k, n in [(4096, 4096), (8192, 8192), (4096, 12288)]:
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    q, s = pg.quantize_weight(w, bits=8)
    wbytes = q.numel() + s.numel() * s.element_size()
    qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(rotation(wbytes) - 1)]
    cases.append(((k, n), wbytes, qs, torch.randn(1, k).to(torch.bfloat16)))
for r in range(3):
    for kn, wbytes, qs, x in cases:
        bw = read_bandwidth(min_time=0.25)
        t, _ = timeit(lambda i: pg.mixed_linear(x, *qs[i % len(qs)], bits=8), min_time=0.3)
        gbs = wbytes / t / 1e9
        print(f"round {r} K, N = {kn}: {gbs:5.1f} GB/s ({gbs / bw:.0%} of the probe's {bw:.1f}), "
              f"{t * 1e6:.0f} us", flush=True)

"""int4 g128 mixed_linear at M = 2, 4, 8 against torch._weight_int4pack_mm_for_cpu, the same
rotated weights, in alternating rounds (bench/CPU_NOTES.md, section 42: is the committed
Zen 5 table's (4096, 22016) M = 4 row, 5.05 ms against 4.82 at M = 8, the kernel or the VM?).
From the repository root, with portable_gemm installed:

    python bench/probes/cpu_int4_small_m.py [ROUNDS]
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_bench import rotation, timeit, torch_int4  # noqa: E402

import portable_gemm as pg  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
torch.manual_seed(0)
cases = []
for k, n in [(4096, 22016), (4096, 12288)]:
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    q, s = pg.quantize_weight(w, bits=4, group_size=128)
    wbytes = q.numel() + s.numel() * s.element_size()
    qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(rotation(wbytes) - 1)]
    ref = torch_int4(w, 128)
    for m in (2, 4, 8):
        cases.append(((k, n, m), qs, ref, torch.randn(m, k).to(torch.bfloat16)))
times: dict = {c[0]: {"ours": [], "torch": []} for c in cases}
for r in range(rounds):
    for key, qs, ref, x in cases:
        t_ours, _ = timeit(lambda i: pg.mixed_linear(x, *qs[i % len(qs)], bits=4, group_size=128), min_time=0.3)
        t_ref, _ = timeit(lambda i: ref(x, i), min_time=0.3)
        times[key]["ours"].append(t_ours)
        times[key]["torch"].append(t_ref)
        print(f"round {r} (K, N, M) = {key}: ours {t_ours * 1e3:6.2f} ms  torch {t_ref * 1e3:6.2f} ms  "
              f"x{t_ref / t_ours:.2f}", flush=True)
print("\nmedians over rounds (ratio: median of per-round torch / ours):")
for key, tt in times.items():
    ratio = statistics.median(b / a for a, b in zip(tt["ours"], tt["torch"]))
    print(f"  (K, N, M) = {key}: ours {statistics.median(tt['ours']) * 1e3:6.2f} ms  "
          f"torch {statistics.median(tt['torch']) * 1e3:6.2f} ms  x{ratio:.2f}  "
          f"(ours {min(tt['ours']) * 1e3:.2f}-{max(tt['ours']) * 1e3:.2f} ms)")

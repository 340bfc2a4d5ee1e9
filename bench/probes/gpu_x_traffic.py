"""Does the small-M tensor-core kernel's M = 9..16 cost come from reading x, or from its own work?

bench/GPU_NOTES.md: at K = N = 8192, int4 g128, M = 16 takes ~1.5x the time of M = 1, while
the kernel reads the same weight bytes. Every block of 32 weight rows reads all of x
(M x K x 2 bytes: 256 KiB at M = 16, as much again as its own weights at M = 8), so at M = 16
the blocks read 64 MiB of x through L2 and L1 for 32 MiB of weights. This probe runs the
same kernel on the same instruction stream with x's rows all at one address (x = one row
expanded to M rows, row stride 0): every x load after the first of a chunk then hits in L1,
and the L2 traffic of x is that of M = 1. If M = 16 with that x runs at its M = 1 / M = 8
time, the reading of x bounds it; if not, the kernel's own instructions and latency do.

For each case it prints CUDA-graph replay times (20 calls, weights rotated past L2, random
data) of: M = 1, M = 8, M = 16 contiguous, M = 16 with the row-stride-0 x, and bf16
F.linear at M = 16 as the in-process reference. Rounds alternate the variants.

    python bench/probes/gpu_x_traffic.py [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_bench import copies_for, graph_time_us  # noqa: E402

# (K, N, bits, group)
CASES = [(8192, 8192, 4, 128), (8192, 8192, 8, 0), (28672, 8192, 4, 128), (4096, 12288, 4, 128)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import portable_gemm as pg

    results = []
    for k, n, bits, g in CASES:
        gen = torch.Generator(device="cuda").manual_seed(7)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        q, s = pg.quantize_weight(w, bits=bits, group_size=g or None)
        nq = copies_for(q.numel() * q.element_size() + s.numel() * s.element_size())
        qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(nq - 1)]
        ws = [w] + [w.clone() for _ in range(min(nq, 4) - 1)]
        x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        x1 = x16[:1]
        xs = {"M=1": x1, "M=8": x16[:8].contiguous(), "M=16": x16,
              "M=16 x stride 0": x1.expand(16, k)}
        # The stride-0 x must give the M = 1 result on every row: bit-equal where M = 16 runs
        # the same chunking as M = 1, within a rounding where it takes half chunks (K <= 8192).
        y0 = pg.mixed_linear(xs["M=16 x stride 0"], q, s, bits=bits, group_size=g or None)
        y1 = pg.mixed_linear(x1, q, s, bits=bits, group_size=g or None)
        same = ((y0.float() - y1.float()).abs().max() / y1.float().abs().max()).item()

        def ours(x):
            return lambda i=0: pg.mixed_linear(x, *qs[i % nq], bits=bits, group_size=g or None)

        def ref(i=0):
            return torch.nn.functional.linear(x16, ws[i % len(ws)])

        times: dict[str, list[float]] = {key: [] for key in [*xs, "F.linear M=16"]}
        for _ in range(args.rounds):
            for key, x in xs.items():
                times[key].append(graph_time_us(ours(x), 20))
            times["F.linear M=16"].append(graph_time_us(ref, 20))
        best = {key: min(v) for key, v in times.items()}
        name = f"({k},{n}) int{bits} g{g or 'ch'}"
        print(f"{name}: stride-0 rows against M=1: max |diff| / max |y| = {same:.1e}")
        for key, v in best.items():
            print(f"  {key:18s} {v:8.2f} us  (rounds {', '.join(f'{t:.2f}' for t in times[key])})"
                  f"  / M=1 {v / best['M=1']:.2f}", flush=True)
        results.append({"case": name, "stride0_rel_diff": same, "times_us": times, "best_us": best})
        del qs, ws
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                "portable_gemm": pg.__version__ if hasattr(pg, "__version__") else None}
        (args.out / "x_traffic.json").write_text(json.dumps({"meta": meta, "results": results},
                                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

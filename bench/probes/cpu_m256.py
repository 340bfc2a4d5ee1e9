"""Weight-only mixed_linear at M = 256 against bf16 F.linear, CPU, one process, alternating
rounds (bench/CPU_NOTES.md 70): the issue-6 row "int8 / int4 g128 M = 256 >= 1x bf16
F.linear" on its own, for a host where the full bench (cpu_bench.py, ~1 h on 2 threads)
does not fit, e.g. the GPU machine's AMX host in one device call.

    python bench/probes/cpu_m256.py --threads 2 [--rounds 5] [--shapes 4096x4096,8192x28672]

Each round times, for every shape, bf16 F.linear, then int8 per channel, then int4 g128
(a loop of calls each, the median call), on the same x. The ratio of a round is F.linear's
time over ours (above 1: ours is faster); the table gives the median and range over rounds,
and the GFLOP/s of the median calls. Outputs are checked against float64 first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import portable_gemm as pg

SHAPES = [(4096, 4096), (4096, 12288), (4096, 22016), (11008, 4096), (8192, 8192), (8192, 28672)]
SCHEMES = [("int8 gchan", 8, None), ("int4 g128", 4, 128)]


def median_call(fn, min_s: float = 0.25, min_calls: int = 3) -> float:
    fn()  # warm (scratch, packing buffers)
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < min_calls or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--shapes", default="", help="KxN,... (default: the issue's six Llama shapes)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    info = pg.info()
    print(f"torch {torch.__version__}, target {info['target']}, {args.threads} threads, "
          f"cpu_isa {info['features']['cpu_isa']}, M = {args.m}", flush=True)
    torch.manual_seed(0)
    cases = []
    for k, n in shapes:
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        x = torch.randn(args.m, k, dtype=torch.bfloat16)
        quant = {}
        for name, bits, group in SCHEMES:
            q, s = pg.quantize_weight(w, bits=bits, group_size=group)
            ref = x[:8].double() @ pg.dequantize_weight(q, s, bits=bits, group_size=group, dtype=torch.float64).T
            got = pg.mixed_linear(x[:8], q, s, bits=bits, group_size=group).double()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise SystemExit(f"{name} {k}x{n}: relative error {err:.2e} against float64")
            quant[name] = (q, s, bits, group)
        cases.append(((k, n), w, x, quant))
    ratios: dict[tuple, list[float]] = {}
    best: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        t_round = time.perf_counter()
        for (k, n), w, x, quant in cases:
            t_ref = median_call(lambda: torch.nn.functional.linear(x, w))
            best.setdefault(((k, n), "F.linear"), []).append(t_ref)
            for name, (q, s, bits, group) in quant.items():
                t = median_call(lambda: pg.mixed_linear(x, q, s, bits=bits, group_size=group))
                ratios.setdefault(((k, n), name), []).append(t_ref / t)
                best.setdefault(((k, n), name), []).append(t)
        print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - t_round:.1f} s", flush=True)
    print(f"\n| K x N | scheme | F.linear / ours, median (range over {args.rounds} rounds) | ours GFLOP/s "
          "| F.linear GFLOP/s |")
    print("|---|---|---|---|---|")
    for (k, n), _, _, quant in cases:
        flop = 2.0 * args.m * k * n
        for name in quant:
            rs = ratios[((k, n), name)]
            print(f"| {k} x {n} | {name} | {statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f}) "
                  f"| {flop / statistics.median(best[((k, n), name)]) / 1e9:.0f} "
                  f"| {flop / statistics.median(best[((k, n), 'F.linear')]) / 1e9:.0f} |")


if __name__ == "__main__":
    main()

"""Host time per call of two builds in one process (run 80): the installed portable_gemm and
a vendored copy of another build under its own namespace, e.g.

    PYTHONPATH=SITE_OLD python -m portable_gemm vendor --into VDIR/pg_old --namespace pg_old
    PYTHONPATH=SITE_NEW:VDIR python bench/probes/gpu_host_ab.py --other pg_old

Separate processes cannot compare a few microseconds of host time on the H200 machine: each
process lands in one of the host's two speed modes (bench/GPU_NOTES.md, run 45a), so both
sides share one process here. Loops of 5000 calls (300 to warm up, one sync per loop) of
int4 g128 M = 1 on a 4096^2 weight (a ~6 us kernel: the loop is host-bound), the two builds
alternating (which goes first alternates too), next to bf16 F.linear and torch.empty.
Prints each loop, then per case the median over rounds and other / installed.
"""

import argparse
import importlib
import statistics
import time

import torch

import portable_gemm as pg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", required=True, help="module name of the vendored copy")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    other = importlib.import_module(args.other)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)
    q, s = pg.quantize_weight(w, bits=4, group_size=128)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    y_new = pg.mixed_linear(x, q, s, bits=4, group_size=128)
    y_old = other.mixed_linear(x, q, s, bits=4, group_size=128)
    print(f"outputs equal: {torch.equal(y_new, y_old)}; installed {pg.__file__}; other {other.__file__}")
    cases = {
        "installed mixed_linear": lambda: pg.mixed_linear(x, q, s, bits=4, group_size=128),
        f"{args.other} mixed_linear": lambda: other.mixed_linear(x, q, s, bits=4, group_size=128),
        "F.linear bf16": lambda: torch.nn.functional.linear(x, w),
        "torch.empty": lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device=dev),
    }
    names = list(cases)
    times = {n: [] for n in names}
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else [names[1], names[0]] + names[2:]
        for name in order:
            f = cases[name]
            for _ in range(300):
                f()
            sync()
            t = time.perf_counter()
            for _ in range(args.calls):
                f()
            sync()
            us = (time.perf_counter() - t) / args.calls * 1e6
            times[name].append(us)
            print(f"round {rnd} {name:26s} {us:6.2f} us/call", flush=True)
    print("median over rounds:")
    for n in names:
        print(f"  {n:26s} {statistics.median(times[n]):6.2f} us/call")
    ratios = [o / i for i, o in zip(times[names[0]], times[names[1]])]
    print(f"per round, {args.other} / installed: " + " ".join(f"{r:.3f}" for r in ratios)
          + f"; median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

"""Our CPU ops right after a torch op, on each way of threading them (bench/CPU_NOTES.md 43).

After a parallel torch op, torch's OpenMP workers spin-wait for more work (GNU OpenMP spins
for milliseconds before it sleeps). A pool of our own then shares the cores with them. Each
child process times, per case, the call alone and the call right after a small parallel
torch op (`t.add_(1)` over 64 Ki floats, ~10 us: it wakes torch's OpenMP team), under one of

  * `default`: the target the loader picks (2.13 on torch 2.13, 2.11 on torch 2.11), torch's
    pool through torch::stable::parallel_for;
  * `2.9`: target 2.9, torch's OpenMP runtime called directly (torch_openmp.h);
  * `2.9 own`: target 2.9 on the library's own pool (PORTABLE_GEMM_POOL=own).

The parent alternates the three for `--rounds` rounds (the order rotates each round) and
prints, per arm and case, the median over rounds of the child's medians, and the
after / alone ratio.

    python bench/probes/cpu_after_torch_op.py --rounds 5 [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time, torch, portable_gemm as pg
torch.set_num_threads(int(sys.argv[1])); torch.manual_seed(0)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
w = (torch.randn(4096, 4096) * 0.02).bfloat16()
q4, s4 = pg.quantize_weight(w, bits=4, group_size=128)
x1, x16 = torch.randn(1, 4096).bfloat16(), torch.randn(16, 4096).bfloat16()
t = torch.zeros(1 << 16)
cases = {"gemm f32 1024": lambda: pg.gemm(a, b),
         "int4 g128 4096^2 M=1": lambda: pg.mixed_linear(x1, q4, s4, bits=4, group_size=128),
         "int4 g128 4096^2 M=16": lambda: pg.mixed_linear(x16, q4, s4, bits=4, group_size=128)}
def median_ms(f, after, budget=0.4):
    f()
    ts, end = [], time.perf_counter() + budget
    while time.perf_counter() < end or len(ts) < 5:
        if after:
            t.add_(1.0)
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
res = {"threading": pg.info()["features"]["threading"]}
for name, f in cases.items():
    res[name] = {"alone": median_ms(f, False), "after": median_ms(f, True)}
print("PROBE" + json.dumps(res))
"""

ARMS = {"default": {},
        "2.9": {"PORTABLE_GEMM_TARGET": "2.9"},
        "2.9 own": {"PORTABLE_GEMM_TARGET": "2.9", "PORTABLE_GEMM_POOL": "own"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    names = list(ARMS)
    got: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            env = {k: v for k, v in os.environ.items()
                   if k not in ("PORTABLE_GEMM_TARGET", "PORTABLE_GEMM_POOL", "PORTABLE_GEMM_NUM_THREADS")}
            env.update(ARMS[n])
            p = subprocess.run([sys.executable, "-c", CHILD, str(args.threads)], env=env,
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"{n}: exit {p.returncode}\n{p.stderr[-2000:]}")
            got[n].append(json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("PROBE"))[5:]))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    cases = [k for k in got[names[0]][0] if k != "threading"]
    print(f"\nmedian over {args.rounds} rounds of each process's median, ms ({args.threads} threads)")
    print(f"{'arm':8} {'threading':28} {'case':24} {'alone':>8} {'after':>8} {'after/alone':>11}")
    for n in names:
        for c in cases:
            alone = statistics.median(x[c]["alone"] for x in got[n])
            after = statistics.median(x[c]["after"] for x in got[n])
            print(f"{n:8} {got[n][0]['threading']:28} {c:24} {alone:8.3f} {after:8.3f} {after / alone:11.2f}")


if __name__ == "__main__":
    main()

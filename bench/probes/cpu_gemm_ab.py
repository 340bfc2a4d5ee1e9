"""Dense `gemm` of two builds in one process, next to torch.matmul (bench/CPU_NOTES.md, 46):
the installed portable_gemm and a vendored copy of another build under its own namespace,
e.g.

    PYTHONPATH=SITE_OLD python -m portable_gemm vendor --into VDIR/pg_old --namespace pg_old
    PYTHONPATH=SITE_NEW:VDIR python bench/probes/cpu_gemm_ab.py --other pg_old --size 1024

On the 2-core VMs the speed of a process moves by 10-30 % within seconds, so separate
processes per build need many rounds to see a 5 % change. Here each round times the
installed build, the other build and (fp32 only) torch.matmul in turn on the same inputs,
a loop of calls each; the rounds' ratios other / installed are what to read. Both results
are checked against float64 first.
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
    ap.add_argument("--size", type=int, default=1024, help="M = N = K")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--flop", type=float, default=2e10, help="FLOPs per timed loop (sets its length)")
    args = ap.parse_args()
    other = importlib.import_module(args.other)
    n, dt = args.size, getattr(torch, args.dtype)
    torch.manual_seed(0)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    ref = a.double() @ b.double()
    tol = 1e-5 if dt == torch.float32 else 2e-2
    for name, mod in (("installed", pg), (args.other, other)):
        err = ((mod.gemm(a, b).double() - ref).abs().max() / ref.abs().max()).item()
        if not err < tol:
            raise SystemExit(f"{name}: relative error {err:.3g} above {tol}")
    fns = {"installed": lambda: pg.gemm(a, b), "other": lambda: other.gemm(a, b)}
    if dt == torch.float32:  # torch's bf16 / f16 matmul has no fast path on some CPUs (seconds a call)
        fns["torch"] = lambda: torch.matmul(a, b)
    reps = max(3, int(args.flop / (2 * n**3)))
    ms: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(args.rounds):
        for k, f in fns.items():
            f()
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            ms[k].append((time.perf_counter() - t0) / reps * 1e3)
        print(f"round {r:2d}: " + "  ".join(f"{k} {v[-1]:8.2f} ms" for k, v in ms.items())
              + f"  other / installed {ms['other'][-1] / ms['installed'][-1]:.3f}", flush=True)
    ratio = [o / i for o, i in zip(ms["other"], ms["installed"])]
    print(f"{args.dtype} {n}^3, {reps} calls a loop, {args.rounds} rounds; median ms: "
          + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in ms.items()))
    print(f"other / installed per round: median {statistics.median(ratio):.3f}, "
          f"range {min(ratio):.3f}-{max(ratio):.3f}, installed faster in {sum(x > 1 for x in ratio)}/{len(ratio)}")
    if "torch" in ms:
        for k in ("installed", "other"):
            per = [t / x for t, x in zip(ms["torch"], ms[k])]
            print(f"torch.matmul / {k} per round: median {statistics.median(per):.3f}")


if __name__ == "__main__":
    main()

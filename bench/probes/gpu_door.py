"""The DLPack door's weight-only linear on the GPU, against the torch op and bf16 F.linear in
the same process, and across two builds (run 61; `--cases small`: with and without out=).

Each `run` process times, per case, `portable_gemm.dlpack.mixed_linear` (torch tensors in, on
torch's current stream), `pg.mixed_linear` and bf16 `F.linear` with CUDA events around
back-to-back calls (eager: the door allocates its output with cudaMalloc, so it cannot be
captured in a CUDA graph), weights rotated past L2, random inputs, and saves the door's
output per case. Run it alternately under each build's PYTHONPATH, then compare:

    PYTHONPATH=SITE_A python bench/probes/gpu_door.py run --tag A --out DIR
    PYTHONPATH=SITE_B python bench/probes/gpu_door.py run --tag B --out DIR
    ... (more rounds: the files are appended to)
    python bench/probes/gpu_door.py compare --out DIR A B

`compare` prints, per case, the best time of each build over the rounds, B / A for the door,
each build's door and torch op against F.linear, and how far B's door output is from A's.

`--cases small` (M = 1..256, a build with out=) also times the door writing into a
preallocated out (no cudaMalloc, no synchronising cudaFree), and checks its output against
the fresh one; one build is enough: every ratio is within the process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gpu_ab import case_inputs, load_best, rel_diff, save_round  # the A/B's round files (same folder)

# (K, N, bits, group, M): the sm_90 GEMM's arguments (g128, per channel), ones it refuses
# (g32, N % 8 != 0), M from just past the small-M kernels to prefill sizes.
CASES = [
    (k, n, bits, g, m)
    for (k, n) in [(8192, 8192), (4096, 12288)]
    for bits, g in [(4, 128), (4, 32), (8, 0)]
    for m in (65, 256, 1024, 4096)
] + [(28672, 8192, 4, 128, m) for m in (256, 4096)] + [(8192, 8196, 8, 0, m) for m in (256, 1024)]


# M from decode to the first sizes past the GEMV, where the door's allocation dominates.
SMALL = [(k, n, bits, g, m) for (k, n) in [(8192, 8192), (4096, 12288)] for bits, g in [(4, 128), (8, 0)]
         for m in (1, 16, 64, 256)]


def name(c) -> str:
    k, n, bits, g, m = c
    return f"({k},{n}) int{bits} g{g or 'ch'} M={m}"


def run(tag: str, out: Path, cases: str = "many") -> None:
    import portable_gemm as pg
    from portable_gemm import dlpack

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu_bench import event_time_us

    res, outs = {}, {}
    for c in SMALL if cases == "small" else CASES:
        k, n, bits, g, m = c
        x, q, s, qs, ws = case_inputs(k, n, bits, g, m, torch.bfloat16)
        nq = len(qs)
        stream = torch.cuda.current_stream().cuda_stream
        outs[name(c)] = dlpack.mixed_linear(x, q, s, bits, group_size=g or None, stream=stream).float().cpu()

        def door(i=0):
            qq, ss = qs[i % nq]
            return dlpack.mixed_linear(x, qq, ss, bits, group_size=g or None, stream=stream)

        def op(i=0):
            qq, ss = qs[i % nq]
            return pg.mixed_linear(x, qq, ss, bits=bits, group_size=g or None)

        def ref(i=0):
            return torch.nn.functional.linear(x, ws[i % len(ws)])

        iters = 10 if m >= 1024 else 40
        res[name(c)] = {"door_us": event_time_us(door, iters, reps=5)[0], "op_us": event_time_us(op, iters, reps=5)[0],
                        "ref_us": event_time_us(ref, iters, reps=5)[0]}
        r = res[name(c)]
        extra = ""
        if cases == "small":
            y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")

            def door_out(i=0):
                qq, ss = qs[i % nq]
                return dlpack.mixed_linear(x, qq, ss, bits, group_size=g or None, stream=stream, out=y)

            door_out()
            torch.cuda.synchronize()
            assert torch.equal(y.float().cpu(), outs[name(c)]), f"{name(c)}: out= differs from the fresh result"
            r["door_out_us"] = event_time_us(door_out, iters, reps=5)[0]
            extra = (f"  door out= {r['door_out_us']:9.1f} us  x F.linear {r['ref_us'] / r['door_out_us']:.2f}"
                     f"  x op {r['op_us'] / r['door_out_us']:.2f}")
        print(f"{tag} {name(c):32s} door {r['door_us']:9.1f} us  op {r['op_us']:9.1f} us  "
              f"F.linear {r['ref_us']:9.1f} us  door x F.linear {r['ref_us'] / r['door_us']:.2f}{extra}", flush=True)
        del qs, ws
        torch.cuda.empty_cache()
    save_round(out, "door", tag, res, outs)


def compare(out: Path, a: str, b: str) -> None:
    ra, na, oa = load_best(out, "door", a)
    rb, nb, ob = load_best(out, "door", b)
    print(f"best of {na} ({a}) / {nb} ({b}) rounds, eager; x F.linear above 1: faster than bf16 F.linear")
    print(f"| case | door {a} us | door {b} us | {b} / {a} | door {a} x F.linear | door {b} x F.linear | "
          f"op x F.linear ({b}) | max abs diff / max abs |")
    print("|---|---|---|---|---|---|---|---|")
    for c in ra:
        A, B = ra[c], rb[c]
        diff = rel_diff(oa[c], ob[c])
        print(f"| {c} | {A['door_us']:.1f} | {B['door_us']:.1f} | {B['door_us'] / A['door_us']:.3f} | "
              f"{A['ref_us'] / A['door_us']:.2f} | {B['ref_us'] / B['door_us']:.2f} | {B['ref_us'] / B['op_us']:.2f} | "
              f"{diff:.1e} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--tag", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--cases", choices=["many", "small"], default="many",
                   help="many: M >= 65 (run 61); small: M = 1..256 with and without out=")
    c = sub.add_parser("compare")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.tag, args.out, args.cases)
    else:
        compare(args.out, args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())

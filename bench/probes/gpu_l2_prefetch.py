"""One-process A/B of an L2 bulk prefetch at the start of the small-M GEMV's blocks (run 85).

A build with the experimental switch PG_L2PF (`bench/probes/gemv_l2_bulk_prefetch.patch`
applied; not in the shipped kernels: refuted, bench/GPU_NOTES.md run 85a) takes the bytes of
each weight row that a block asks the copy engine to bring into L2 before its loop
(`cp.async.bulk.prefetch.L2`; unset or 0: off, -1: the whole row). It is timed under several
settings in the same process, in alternating rounds (the setting's order rotates each round),
on the same inputs: CUDA-graph replay of 20 calls and eager CUDA events, weights rotated
past L2, random data. Each setting's output must equal setting 0's bit for bit (a prefetch
changes no arithmetic).

    python bench/probes/gpu_l2_prefetch.py --rounds 3 --settings 0,-1,2048,1024

Prints, per case and setting, the best graph / eager time over the rounds, the ratio to
setting 0's, the rounds won, and bf16 F.linear's graph time for the goal ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_ab import case_inputs, name  # noqa: E402
from gpu_bench import event_time_us, graph_time_us  # noqa: E402

# (K, N, bits, group, M, x dtype): the goal shapes at M = 1..16, both schemes, plus shapes
# whose rows are longer than the L2 holds at once, and M > 16 (slices, four x tiles).
CASES = [
    (8192, 8192, 4, 128, m, "bf16") for m in (1, 8, 16)
] + [
    (8192, 8192, 4, 0, 16, "bf16"), (8192, 8192, 8, 128, 1, "bf16"), (8192, 8192, 8, 128, 16, "bf16"),
    (8192, 8192, 8, 0, 16, "bf16"), (28672, 8192, 4, 128, 1, "bf16"), (28672, 8192, 4, 128, 16, "bf16"),
    (28672, 8192, 8, 0, 16, "bf16"), (8192, 28672, 4, 128, 16, "bf16"), (4096, 4096, 4, 128, 16, "bf16"),
    (4096, 12288, 4, 128, 1, "bf16"), (11008, 4096, 4, 128, 16, "bf16"), (8192, 8192, 4, 128, 32, "bf16"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default="0,-1,2048,1024")
    ap.add_argument("--only", default="", help="substring of the case names to keep")
    args = ap.parse_args()
    import portable_gemm as pg

    settings = [int(v) for v in args.settings.split(",")]
    assert settings[0] == 0, "the first setting is the reference: 0 (off)"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, settings {settings}", flush=True)
    for c in CASES:
        if args.only and args.only not in name(c):
            continue
        k, n, bits, g, m, dt = c
        x, q, s, qs, ws = case_inputs(k, n, bits, g, m, {"bf16": torch.bfloat16, "f16": torch.float16}[dt])
        nq = len(qs)

        def ours(i=0):
            qq, ss = qs[i % nq]
            return pg.mixed_linear(x, qq, ss, bits=bits, group_size=g or None)

        ref_us = graph_time_us(lambda i=0: torch.nn.functional.linear(x, ws[i % len(ws)]), 20)
        times = {v: {"graph": [], "eager": []} for v in settings}
        outs = {}
        for r in range(args.rounds):
            order = settings[r % len(settings):] + settings[:r % len(settings)]
            for v in order:
                os.environ["PG_L2PF"] = str(v)
                outs.setdefault(v, ours().float().cpu())
                times[v]["graph"].append(graph_time_us(ours, 20))
                times[v]["eager"].append(event_time_us(ours, 50)[0])
        os.environ["PG_L2PF"] = "0"
        base = times[0]
        line = [f"{name(c):36s} F.linear {ref_us:7.2f}"]
        for v in settings:
            gb, eb = min(times[v]["graph"]), min(times[v]["eager"])
            won = sum(a < b for a, b in zip(times[v]["graph"], base["graph"]))
            same = torch.equal(outs[v], outs[0])
            line.append(f"| pf {v:>5}: graph {gb:7.2f} ({gb / min(base['graph']):.3f}, won {won}/{args.rounds}, "
                        f"{ref_us / gb:.2f}x) eager {eb:7.2f} ({eb / min(base['eager']):.3f})"
                        + ("" if same else " OUTPUT DIFFERS"))
        print("\n    ".join(line), flush=True)
        del qs, ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A/B of two builds of the CUDA kernels on the small-M (GEMV) cases, one process per build.

Each process times `pg.mixed_linear` for a fixed list of cases (CUDA-graph replay of 20
calls and eager CUDA events, weights rotated past L2, random inputs) next to bf16 F.linear
(the in-process reference), and saves one output per case computed from seeded inputs.
Run it alternately under each build's PYTHONPATH, for several rounds, then compare:

    PYTHONPATH=SITE_A python bench/probes/gpu_ab.py run --tag A --out DIR
    PYTHONPATH=SITE_B python bench/probes/gpu_ab.py run --tag B --out DIR
    ... (more rounds: the files are appended to)
    python bench/probes/gpu_ab.py compare --out DIR A B

`compare` prints, per case, the best time of each build over the rounds and B / A (graph
replay and eager), the ratio to F.linear of each, and how far B's output is from A's
(max |B - A| / max |A|). `score TABLE` reads a saved `compare` table and scores routing
rules of the form "A up to T MiB of quantised weight, B above" (run 57):

    python bench/probes/gpu_ab.py score bench/results/gpu_route_run57.txt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


# (K, N, bits, group, M, x dtype)
CASES = [
    (8192, 8192, 4, 128, 1, "bf16"), (8192, 8192, 4, 128, 8, "bf16"),
    (8192, 8192, 4, 128, 12, "bf16"), (8192, 8192, 4, 128, 16, "bf16"),
    (8192, 8192, 4, 0, 16, "bf16"), (8192, 8192, 4, 64, 16, "bf16"),
    (8192, 8192, 4, 32, 16, "bf16"), (8192, 8192, 4, 128, 16, "f16"),
    (8192, 8192, 8, 0, 16, "bf16"), (8192, 8192, 8, 128, 16, "bf16"),
    (28672, 8192, 4, 128, 16, "bf16"), (28672, 8192, 4, 0, 16, "bf16"),
    (8192, 28672, 4, 128, 16, "bf16"), (4096, 12288, 4, 128, 16, "bf16"),
    (4096, 12288, 4, 0, 16, "bf16"), (4096, 4096, 4, 128, 16, "bf16"),
    (11008, 4096, 4, 128, 16, "bf16"), (4096, 22016, 4, 128, 16, "bf16"),
    (28672, 8192, 4, 128, 1, "bf16"), (28672, 8192, 4, 128, 9, "bf16"),
    # K > 8192 at every small M (run 45: the wide blocks)
    (28672, 8192, 4, 128, 8, "bf16"), (28672, 8192, 4, 128, 12, "bf16"),
    (28672, 8192, 4, 0, 8, "bf16"), (28672, 8192, 8, 0, 1, "bf16"),
    (28672, 8192, 8, 0, 8, "bf16"), (28672, 8192, 8, 0, 16, "bf16"),
    (28672, 8192, 8, 128, 16, "bf16"), (28672, 8192, 4, 128, 16, "f16"),
    # M <= 8 and int8 at 8192^2, the smallest shape, per channel at K > 8192 (run 46: the
    # weights through shared memory)
    (8192, 8192, 4, 128, 4, "bf16"), (8192, 8192, 4, 0, 1, "bf16"), (8192, 8192, 8, 0, 1, "bf16"),
    (8192, 8192, 8, 0, 8, "bf16"), (4096, 4096, 4, 128, 1, "bf16"), (28672, 8192, 4, 0, 1, "bf16"),
]
# --cases mid: 16 < M <= 64, where the small-M GEMV in slices of 16 rows of x meets the GEMMs
# for many rows (run 47); the shapes of issue 7, int4 g128 and int8 per channel, plus int4
# per channel and f16 x at 8192^2.
MID_CASES = [
    (k, n, bits, g, m, "bf16")
    for (k, n) in [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096), (4096, 12288),
                   (11008, 4096), (4096, 22016)]
    for bits, g in [(4, 128), (8, 0)]
    for m in (24, 32, 48, 64)
] + [(8192, 8192, 4, 0, m, "bf16") for m in (17, 32, 64)] + [
    (8192, 8192, 4, 128, 17, "bf16"), (8192, 8192, 4, 128, 32, "f16"), (8192, 8192, 4, 128, 16, "bf16"),
]
# --cases wg: M = 9..32 on the shapes of issue 7 (the sm_90a wgmma GEMV against the mma.sync
# one), the schemes that take different code paths (chunk scales, per channel, folded groups,
# int8, f16 x), plus M <= 8 controls that no switch touches.
WG_CASES = [
    (k, n, 4, 128, m, "bf16")
    for (k, n) in [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 12288), (4096, 22016),
                   (11008, 4096), (4096, 4096)]
    for m in (9, 16)
] + [
    (8192, 8192, 4, 0, 16, "bf16"), (8192, 8192, 4, 32, 16, "bf16"), (8192, 8192, 4, 64, 16, "bf16"),
    (8192, 8192, 4, 128, 16, "f16"), (8192, 8192, 8, 0, 16, "bf16"), (8192, 8192, 8, 128, 16, "bf16"),
    (28672, 8192, 8, 0, 16, "bf16"), (28672, 8192, 4, 0, 16, "bf16"), (8192, 8192, 4, 128, 12, "bf16"),
    (8192, 8192, 4, 128, 24, "bf16"), (8192, 8192, 4, 128, 32, "bf16"), (28672, 8192, 4, 128, 32, "bf16"),
    (8192, 8192, 8, 0, 32, "bf16"),
    (8192, 8192, 4, 128, 1, "bf16"), (8192, 8192, 4, 128, 8, "bf16"), (28672, 8192, 4, 128, 8, "bf16"),
]
# --cases edge: M = 17..32, where the small-M GEMV (int4 in two slices, int8 with four x
# tiles) meets the sm_90 mixed-input GEMM's 64-wide tile (run 55), plus M = 16 controls.
EDGE_CASES = [
    (k, n, bits, g, m, "bf16")
    for (k, n) in [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096), (4096, 12288),
                   (11008, 4096), (4096, 22016)]
    for bits, g in [(4, 128), (8, 0), (8, 128)]
    for m in (17, 24, 32)
] + [(8192, 8192, 4, 128, 16, "bf16"), (8192, 8192, 8, 0, 16, "bf16")]
# --cases edge2: shapes the M = 17..32 routing rule was not fitted on (run 55b), M = 24, plus
# M = 17 and 32 on three of them.
EDGE2_CASES = [
    (k, n, bits, g, 24, "bf16")
    for (k, n, schemes) in [
        (4096, 14336, "4a 8c 8a"), (14336, 4096, "4a 8c"), (5120, 13824, "4a 8c 8a"),
        (13824, 5120, "8c 8a"), (8192, 10240, "4a 8c 8a"), (8192, 57344, "4a 8c 8a"),
        (16384, 16384, "4a 8a"), (8192, 8192, "4c"), (28672, 8192, "4c"), (5120, 5120, "8c"),
        (2048, 8192, "8c"), (4096, 8192, "8c 8a")]
    for bits, g in [{"4a": (4, 128), "4c": (4, 0), "8c": (8, 0), "8a": (8, 128)}[x] for x in schemes.split()]
] + [(k, n, 8, 0, m, "bf16") for (k, n) in [(4096, 14336), (5120, 13824), (2048, 8192)] for m in (17, 32)] + [
    (8192, 8192, 8, 0, 24, "f16"), (28672, 8192, 4, 128, 24, "f16")]
# --cases mid2: M = 33..64, the small-M GEMV in slices (int4: 16 rows, int8: 32 rows with four
# x tiles) against the sm_90 GEMM's 64-wide tile (run 57). The rule is fitted on the issue's 7
# shapes (first list) and scored on shapes it was not fitted on (second list), plus M = 32
# controls that no switch touches.
MID2_FIT = [
    (k, n, bits, g, m, "bf16")
    for (k, n) in [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096), (4096, 12288),
                   (11008, 4096), (4096, 22016)]
    for bits, g in [(4, 128), (8, 0), (8, 128)]
    for m in (40, 48, 64)
]
MID2_HELD = [
    (k, n, bits, g, m, "bf16")
    for (k, n) in [(2048, 2048), (2048, 8192), (8192, 2048), (3072, 3072), (3072, 8192),
                   (8192, 3072), (5120, 5120), (4096, 8192), (4096, 14336), (14336, 4096)]
    for bits, g in [(4, 128), (8, 0)]
    for m in (48, 64)
] + [(k, n, 8, 128, 48, "bf16") for (k, n) in [(2048, 8192), (3072, 8192), (5120, 5120)]] + [
    (k, n, 4, 0, 48, "bf16") for (k, n) in [(4096, 4096), (3072, 8192)]] + [
    (4096, 4096, 4, 128, 48, "f16"), (4096, 4096, 8, 0, 48, "f16")]
MID2_CASES = MID2_FIT + MID2_HELD + [(8192, 8192, 4, 128, 32, "bf16"), (4096, 4096, 8, 0, 32, "bf16")]
# --cases refused: M = 33..64 above 16 MiB of weight where the sm_90 GEMM refuses the
# arguments (groups not a multiple of 64: g32; N % 8 != 0). The torch binding takes the GEMV
# there since 6294989, dequantise + cuBLAS before; M = 65 is the first row count it sends to
# dequantise + cuBLAS, whose time hardly depends on M (it writes and reads a 16-bit copy of
# the weight), so one build's run reads both paths (run 61). Plus an M = 48 g128 control on
# the sm_90 GEMM.
REFUSED_CASES = [
    (k, n, bits, 32, m, "bf16")
    for (k, n) in [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 12288), (11008, 4096), (4096, 22016)]
    for bits in (4, 8)
    for m in (48, 64, 65)
] + [
    (8192, 8196, bits, g, m, "bf16") for (bits, g) in [(4, 128), (8, 0)] for m in (48, 64, 65)
] + [(8192, 8192, 4, 128, 48, "bf16")]
# --cases tail: N not a multiple of the GEMV's 32-row block, where its last rows took the
# SIMT GEMV until run 62 (now one more whole block of the tensor-core GEMV, ending at row
# N), plus controls with N a multiple of 32.
TAIL_CASES = [
    (k, n, bits, g, m, "bf16")
    for (k, n) in [(8192, 8196), (4096, 32001), (4096, 4100)]
    for bits, g in [(4, 128), (8, 0)]
    for m in (1, 16, 48)
] + [(k, n, bits, g, m, "bf16") for (k, n) in [(8192, 8192), (28672, 8192)] for bits, g in [(4, 128), (8, 0)]
     for m in (1, 16, 24)]
# --cases four4: int4 at M = 17..64 with K <= 8192 on the small-M GEMV, in slices of 16 rows
# (two x tiles) or in one pass of four x tiles per 32 rows (run 73: 1.04-1.25x the slices'
# time, reverted; the list now times the slices), the schemes on their own code paths
# (chunk scales, per channel, folded groups, f16 x), plus controls no switch touches
# (M = 16, K > 8192, int8).
FOUR4_CASES = [
    (k, n, 4, 128, m, "bf16") for (k, n) in [(8192, 8192), (4096, 4096), (4096, 12288), (4096, 22016)]
    for m in (17, 24, 32)
] + [
    (8192, 8192, 4, 0, 32, "bf16"), (8192, 8192, 4, 32, 32, "bf16"), (8192, 8192, 4, 64, 24, "bf16"),
    (8192, 8192, 4, 128, 32, "f16"), (4096, 4096, 4, 128, 48, "bf16"), (4096, 4096, 4, 128, 64, "bf16"),
    (8192, 8192, 4, 128, 16, "bf16"), (11008, 4096, 4, 128, 32, "bf16"), (8192, 8192, 8, 0, 32, "bf16"),
]
# --cases pair: int4 half chunks at M = 9..32 in pairs (run 77), on the shapes of issue 7
# (K > 8192 too, where whole chunks ran), the schemes on their own code paths (per channel,
# g128, g256 paired; g64 single half chunks, and whole ones at K > 8192; g32 folded; f16 x
# with f16 scales), the slices above M = 16, plus controls no change touches (M <= 8, int8).
PAIR_CASES = [
    (k, n, 4, g, m, "bf16")
    for (k, n) in [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 12288), (4096, 22016),
                   (11008, 4096), (4096, 4096)]
    for g in (128, 0) for m in (9, 16)
] + [
    (8192, 8192, 4, 128, 12, "bf16"), (8192, 8192, 4, 256, 16, "bf16"), (8192, 8192, 4, 64, 16, "bf16"),
    (8192, 8192, 4, 32, 16, "bf16"), (8192, 8192, 4, 128, 16, "f16"), (28672, 8192, 4, 128, 16, "f16"),
    (8192, 8192, 4, 128, 24, "bf16"), (8192, 8192, 4, 128, 32, "bf16"), (4096, 4096, 4, 0, 32, "bf16"),
    (8192, 8192, 4, 128, 1, "bf16"), (8192, 8192, 4, 128, 8, "bf16"), (8192, 8192, 8, 0, 16, "bf16"),
    (11008, 4096, 4, 128, 24, "bf16"), (11008, 4096, 4, 64, 16, "bf16"), (8192, 8192, 4, 128, 17, "bf16"),
    (8192, 8192, 4, 0, 16, "f16"), (4096, 4096, 8, 0, 32, "bf16"),
]
# --cases route4: int4 at M = 17..32 on the weights of 48 MiB and more, where the sm_90 GEMM
# takes them (run 55's rule), after run 77 made the GEMV's slices faster; run it with and
# without PORTABLE_GEMM_DISABLE_SM90=1 (then the GEMV takes them). M = 48 and 64 at 8192^2
# (32 MiB, the GEMM from 16 MiB, run 57) and (4096, 22016) at M = 24 (43 MiB: the GEMV in
# both) as controls.
ROUTE4_CASES = [
    (k, n, 4, g, m, "bf16") for (k, n) in [(28672, 8192), (8192, 28672)] for g in (128, 0)
    for m in (17, 24, 32)
] + [(8192, 8192, 4, 128, 48, "bf16"), (8192, 8192, 4, 128, 64, "bf16"), (4096, 22016, 4, 128, 24, "bf16")]
# --cases peel: the default list plus the kernels above M = 16 (int4 slices in pairs, int8 with
# four x tiles) and M <= 8 with f16 x, for run 79 (the last chunk of each GEMV loop peeled out).
PEEL_CASES = CASES + [
    (8192, 8192, 4, 128, 24, "bf16"), (8192, 8192, 4, 128, 32, "bf16"), (8192, 8192, 4, 0, 32, "bf16"),
    (8192, 8192, 8, 0, 24, "bf16"), (8192, 8192, 8, 128, 32, "bf16"), (4096, 22016, 4, 128, 24, "bf16"),
    (8192, 8192, 4, 128, 1, "f16"), (8192, 8192, 8, 0, 1, "f16"), (8192, 8192, 4, 0, 8, "bf16"),
    (4096, 12288, 8, 0, 1, "bf16"), (4096, 12288, 4, 128, 1, "bf16"),
]
# --cases route5: int4 at M = 17..32 on weights of 32-112 MiB, run with and without
# PORTABLE_GEMM_DISABLE_SM90=1 to refit run 55's 48 MiB rule for the GEMV after runs 77 and 79
# (run 78 found g128 faster on the GEMV at 112 MiB, per channel even to M = 24).
ROUTE5_CASES = [
    (k, n, 4, g, m, "bf16")
    for (k, n) in [(28672, 8192), (8192, 28672), (16384, 8192), (8192, 16384), (4096, 28672), (28672, 4096)]
    for g in (128, 0)
    for m in (17, 24, 32)
] + [(12288, 8192, 4, 128, 24, "bf16"), (8192, 8192, 4, 128, 24, "bf16"), (28672, 8192, 4, 128, 24, "f16"),
     (28672, 8192, 4, 64, 24, "bf16"), (8192, 8192, 8, 0, 24, "bf16")]
# --cases int8: int8 with bf16 x at M <= 16 (run 81: the weights as bf16 through integer ops,
# pairs (k, k + 2)), both schemes on the two shapes of the goal rows, per channel at M = 16 on
# the other shapes, and controls: f16 x, group 32 (folded scales), M = 24 / 32 (four x tiles), int4.
INT8_CASES = [
    (k, n, 8, g, m, "bf16") for (k, n) in [(8192, 8192), (28672, 8192)] for g in (0, 128) for m in (1, 8, 9, 12, 16)
] + [
    (k, n, 8, 0, 16, "bf16") for (k, n) in [(4096, 4096), (4096, 12288), (4096, 22016), (11008, 4096), (8192, 28672)]
] + [
    (8192, 8192, 8, 0, 16, "f16"), (8192, 8192, 8, 0, 1, "f16"), (8192, 8192, 8, 32, 16, "bf16"),
    (8192, 8192, 8, 0, 24, "bf16"), (8192, 8192, 8, 128, 32, "bf16"),
    (8192, 8192, 4, 128, 1, "bf16"), (8192, 8192, 4, 128, 16, "bf16"),
]
DT = {"bf16": torch.bfloat16, "f16": torch.float16}


# --cases pdl: run 128's cases (each GEMV launch a programmatic dependent launch of the
# kernel before it, bench/probes/gemv_pdl_calls.patch; not kept): M = 1, 8 and 16 on the goal
# shapes' int4 g128 and int8, the smallest and the largest weights, plus N % 32 != 0 (the
# last rows' launch). With --pre, every call follows a kernel of another library.
PDL_CASES = [
    (8192, 8192, 4, 128, 1, "bf16"), (8192, 8192, 4, 128, 8, "bf16"), (8192, 8192, 4, 128, 16, "bf16"),
    (8192, 8192, 4, 0, 16, "bf16"), (8192, 8192, 8, 0, 1, "bf16"), (8192, 8192, 8, 128, 16, "bf16"),
    (28672, 8192, 4, 128, 1, "bf16"), (28672, 8192, 4, 128, 16, "bf16"), (28672, 8192, 8, 0, 16, "bf16"),
    (4096, 4096, 4, 128, 1, "bf16"), (4096, 4096, 4, 128, 16, "bf16"), (4096, 12288, 4, 128, 16, "bf16"),
    (8192, 8196, 4, 128, 16, "bf16"),
]


def name(c) -> str:
    k, n, bits, g, m, dt = c
    return f"({k},{n}) int{bits} g{g or 'ch'} M={m} {dt}"


def run(tag: str, out: Path, cases=CASES, pre: bool = False) -> None:
    """pre: before each call of ours and of F.linear, an in-place elementwise kernel on x
    (x *= 1), so that every call follows a kernel that writes its input, as in a model."""
    import portable_gemm as pg

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu_bench import event_time_us, graph_time_us

    res, outs = {}, {}
    for c in cases:
        k, n, bits, g, m, dt = c
        x, q, s, qs, ws = case_inputs(k, n, bits, g, m, DT[dt])
        nq = len(qs)
        outs[name(c)] = pg.mixed_linear(x, q, s, bits=bits, group_size=g or None).float().cpu()

        def ours(i=0):
            qq, ss = qs[i % nq]
            if pre:
                x.mul_(1)
            return pg.mixed_linear(x, qq, ss, bits=bits, group_size=g or None)

        def ref(i=0):
            if pre:
                x.mul_(1)
            return torch.nn.functional.linear(x, ws[i % len(ws)])

        res[name(c)] = {
            "graph_us": graph_time_us(ours, 20), "eager_us": event_time_us(ours, 50)[0],
            "ref_graph_us": graph_time_us(ref, 20),
        }
        r = res[name(c)]
        print(f"{tag} {name(c):38s} graph {r['graph_us']:7.2f} us  eager {r['eager_us']:7.2f} us  "
              f"F.linear graph {r['ref_graph_us']:7.2f} us", flush=True)
        del qs, ws
        torch.cuda.empty_cache()
    save_round(out, "ab", tag, res, outs)


def case_inputs(k: int, n: int, bits: int, g: int, m: int, dtype: torch.dtype):
    """Seeded random x [m, k] and weight [n, k] (dtype) on the GPU, the weight quantised
    (group g, 0 per channel), and copies to rotate past L2: (x, q, s, [(q, s), ...], [w, ...])."""
    import portable_gemm as pg

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu_bench import copies_for

    gen = torch.Generator(device="cuda").manual_seed(1234)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    q, s = pg.quantize_weight(w, bits=bits, group_size=g or None)
    nq = copies_for(q.numel() * q.element_size() + s.numel() * s.element_size())
    qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(nq - 1)]
    ws = [w] + [w.clone() for _ in range(min(nq, 4) - 1)]
    return x, q, s, qs, ws


def save_round(out: Path, prefix: str, tag: str, res: dict, outs: dict) -> None:
    """Appends one round's times to PREFIX_TAG.jsonl and keeps its outputs (PREFIX_TAG_outputs.pt)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{prefix}_{tag}.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    torch.save(outs, out / f"{prefix}_{tag}_outputs.pt")


def load_best(out: Path, prefix: str, tag: str):
    """Per case, the best (lowest) of each time over a tag's rounds; the number of rounds; its outputs."""
    rounds = [json.loads(line) for line in open(out / f"{prefix}_{tag}.jsonl")]
    best = {c: {key: min(r[c][key] for r in rounds) for key in rounds[0][c]} for c in rounds[0]}
    return best, len(rounds), torch.load(out / f"{prefix}_{tag}_outputs.pt")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |b - a| / max |a|"""
    return ((b - a).abs().max() / a.abs().max()).item()


def compare(out: Path, a: str, b: str) -> None:
    ra, na, oa = load_best(out, "ab", a)
    rb, nb, ob = load_best(out, "ab", b)
    print(f"best of {na} ({a}) / {nb} ({b}) rounds; ratio = {b} / {a} (below 1: {b} is faster)")
    print(f"{'case':38s} | {a + ' graph':>9s} {b + ' graph':>9s} {'ratio':>6s} | {a + ' eager':>9s} "
          f"{b + ' eager':>9s} {'ratio':>6s} | {'x F.lin ' + a:>11s} {'x F.lin ' + b:>11s} | out diff")
    for c in ra:
        x, y = ra[c], rb[c]
        diff = rel_diff(oa[c], ob[c])
        print(f"{c:38s} | {x['graph_us']:9.2f} {y['graph_us']:9.2f} {y['graph_us'] / x['graph_us']:6.3f} | "
              f"{x['eager_us']:9.2f} {y['eager_us']:9.2f} {y['eager_us'] / x['eager_us']:6.3f} | "
              f"{x['ref_graph_us'] / x['graph_us']:11.2f} {y['ref_graph_us'] / y['graph_us']:11.2f} | {diff:.1e}")


def score(table: Path, fit_shapes: set, thresholds: list[float], min_m: int) -> None:
    """Scores "the first path up to T MiB of quantised weight, the second above" on a
    `compare` table (rows with M >= min_m): the summed time of the path the rule picks over
    the summed time of the faster path of each case, graph replay and eager, on the cases of
    fit_shapes' (K, N) with bf16 x and the schemes of the fit (int4 g128, int8 per channel and
    g128) and on every other case."""
    import re

    rows = []
    pat = re.compile(r"\((\d+),(\d+)\) int(\d) g(\w+) M=(\d+) (\w+)\s+\|\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+\|"
                     r"\s+([\d.]+)\s+([\d.]+)")
    for line in table.read_text().splitlines():
        mt = pat.match(line)
        if mt and int(mt[5]) >= min_m:
            k, n, bits = int(mt[1]), int(mt[2]), int(mt[3])
            fit = (k, n) in fit_shapes and mt[6] == "bf16" and (bits, mt[4]) in {(4, "128"), (8, "ch"), (8, "128")}
            rows.append({"mib": k * n * bits / 8 / 2**20, "fit": fit, "name": line.split("|")[0].strip(),
                         "a": (float(mt[7]), float(mt[9])), "b": (float(mt[8]), float(mt[10]))})
    for label, sel in (("fit", [r for r in rows if r["fit"]]), ("other", [r for r in rows if not r["fit"]])):
        print(f"{label}: {len(sel)} cases")
        for t in thresholds + [None]:
            cols = []
            for i, mode in enumerate(("graph", "eager")):
                pick = sum(r["a"][i] if t is not None and r["mib"] <= t else r["b"][i] for r in sel)
                best = sum(min(r["a"][i], r["b"][i]) for r in sel)
                cols.append(f"{mode} {pick / best:.3f}")
            print(f"  {'second path everywhere' if t is None else f'first path up to {t:g} MiB':28s} " + ", ".join(cols))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--tag", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--pre", action="store_true", help="an elementwise kernel writing x before every call (ours and F.linear)")
    r.add_argument("--cases", choices=["small", "mid", "wg", "edge", "edge2", "mid2", "refused", "tail", "four4", "pair", "route4", "peel", "route5", "int8", "pdl"], default="small",
                   help="small: M <= 16 (the default list); mid: 16 < M <= 64; wg: M = 9..32; edge, edge2: M = 17..32; "
                        "mid2: M = 33..64; refused: M = 33..64 where the sm_90 GEMM refuses the arguments; tail: N %% 32 != 0; four4: int4 M = 17..64 at K <= 8192; pair: int4 M = 9..32 (run 77); route4: int4 M = 17..32 from 48 MiB; "
                        "peel: small plus M = 24/32 and f16 x (run 79); route5: int4 M = 17..32 at 32-112 MiB (run 79); "
                        "pdl: M = 1/8/16 on the smallest, goal and largest shapes (run 128)")
    c = sub.add_parser("compare")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("a")
    c.add_argument("b")
    sc = sub.add_parser("score", help="score weight-size thresholds on a saved `compare` table")
    sc.add_argument("table", type=Path)
    sc.add_argument("--min-m", type=int, default=33)
    sc.add_argument("--thresholds", default="4,8,12,16,20,24", help="MiB, comma-separated")
    args = ap.parse_args()
    if args.cmd == "score":
        issue7 = {(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096), (4096, 12288), (11008, 4096), (4096, 22016)}
        score(args.table, issue7, [float(t) for t in args.thresholds.split(",")], args.min_m)
        return 0
    if args.cmd == "run":
        run(args.tag, args.out, {"small": CASES, "mid": MID_CASES, "wg": WG_CASES, "edge": EDGE_CASES, "edge2": EDGE2_CASES,
             "mid2": MID2_CASES, "refused": REFUSED_CASES, "tail": TAIL_CASES, "four4": FOUR4_CASES,
             "pair": PAIR_CASES, "route4": ROUTE4_CASES, "peel": PEEL_CASES, "route5": ROUTE5_CASES, "int8": INT8_CASES,
             "pdl": PDL_CASES}[args.cases], pre=args.pre)
    else:
        compare(args.out, args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())

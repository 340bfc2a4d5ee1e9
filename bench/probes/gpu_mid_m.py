"""Where the time of weight-only calls with 17..256 rows of x goes on the GPU (run 48).

For each case it times `pg.mixed_linear` and bf16 `F.linear` three ways, weights rotated past
L2, random inputs:
- graph: CUDA-graph replay of 20 calls (the kernels alone, no host work);
- eager: CUDA events around 50 back-to-back calls (what a user's eager loop sees);
- host: wall time per call of 400 calls enqueued without a sync (the CPU side alone).
An eager time near the host time and far above the graph time is host-bound.
With --profile it also lists the kernels of one call of a few cases (torch.profiler).
With --tiles 64,128,256 it instead times, in the same process and in alternating rounds,
the CUTLASS mixed-input kernel under each tile width given (the temporary switch
PGX_MIXED_TILE of run 48b, read per call), graph replay, best of the rounds, and prints
each against the shipped choice and bf16 F.linear, with the outputs' distance. The switch
left the library with run 48b: to repeat the A/B, put it back into kernel_choice
(src/kernels/cuda/sm90_mixed.cuh; bench/GPU_NOTES.md, run 48b, has its form).

    python bench/probes/gpu_mid_m.py [--quick] [--profile] [--json FILE]
    python bench/probes/gpu_mid_m.py --tiles 64,128,256 [--rounds 2] [--ms 48,64,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_bench import copies_for, event_time_us, graph_time_us  # noqa: E402

SHAPES = [(4096, 4096), (4096, 12288), (11008, 4096), (8192, 8192), (4096, 22016), (28672, 8192),
          (8192, 28672)]
SCHEMES = [(4, 128), (8, 0)]
MS = (32, 48, 64, 96, 128, 192, 256)
QUICK_MS = (32, 64, 128, 256)


def host_us(fn, n: int = 400) -> float:
    for i in range(20):
        fn(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def cases(ms):
    """Yields (K, N, bits, group, M, ours, ref) for every case: pg.mixed_linear and bf16
    F.linear as fn(i), the weights rotated past L2 over i, random inputs."""
    import portable_gemm as pg

    for k, n in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ws = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]
        for bits, g in SCHEMES:
            q, s = pg.quantize_weight(w, bits=bits, group_size=g or None)
            nq = copies_for(q.numel() * q.element_size() + s.numel() * s.element_size())
            qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(nq - 1)]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

                def ours(i=0, x=x, bits=bits, g=g, qs=qs, nq=nq):
                    qq, ss = qs[i % nq]
                    return pg.mixed_linear(x, qq, ss, bits=bits, group_size=g or None)

                def ref(i=0, x=x):
                    return torch.nn.functional.linear(x, ws[i % len(ws)])

                yield k, n, bits, g, m, ours, ref
            del qs
        del ws, w
        torch.cuda.empty_cache()


def tiles_ab(tiles: list[int], ms, rounds: int) -> None:
    import os

    cols = ["shipped"] + [str(t) for t in tiles]
    print(f"graph replay, best of {rounds} alternating rounds; time / shipped (below 1: faster)")
    print(f"{'K':>6} {'N':>6} {'scheme':>9} {'M':>4} | {'shipped us':>10} " +
          " ".join(f"{'t' + t:>7}" for t in cols[1:]) + f" | {'bf16 us':>8} {'best x bf16':>11} | max diff")
    for k, n, bits, g, m, ours, ref in cases(ms):
        best = {c: float("inf") for c in cols}
        outs = {}
        for _ in range(rounds):
            for c in cols:
                if c == "shipped":
                    os.environ.pop("PGX_MIXED_TILE", None)
                else:
                    os.environ["PGX_MIXED_TILE"] = c
                best[c] = min(best[c], graph_time_us(ours, 20))
                outs[c] = ours().float()
        os.environ.pop("PGX_MIXED_TILE", None)
        r_us = graph_time_us(ref, 20)
        diff = max(((outs[c] - outs["shipped"]).abs().max() / outs["shipped"].abs().max()).item()
                   for c in cols)
        fastest = min(best.values())
        print(f"{k:6d} {n:6d} {'int%d g%s' % (bits, g or 'ch'):>9} {m:4d} | {best['shipped']:10.1f} " +
              " ".join(f"{best[c] / best['shipped']:7.3f}" for c in cols[1:]) +
              f" | {r_us:8.1f} {r_us / fastest:11.2f} | {diff:.1e}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"M in {QUICK_MS} only")
    ap.add_argument("--profile", action="store_true", help="list the kernels of a few calls")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tiles", help="comma-separated tile widths to A/B (64, 128, 256)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ms", help="comma-separated M list (default: %s)" % (MS,))
    args = ap.parse_args()
    if args.tiles:
        ms = [int(v) for v in args.ms.split(",")] if args.ms else MS
        tiles_ab([int(t) for t in args.tiles.split(",")], ms, args.rounds)
        return 0
    import portable_gemm as pg

    ms = QUICK_MS if args.quick else MS
    rows = []
    print(f"{'K':>6} {'N':>6} {'scheme':>9} {'M':>4} | {'ours graph':>10} {'eager':>7} {'host':>7} | "
          f"{'bf16 graph':>10} {'eager':>7} {'host':>7} | {'x graph':>7} {'x eager':>7}", flush=True)
    for k, n, bits, g, m, ours, ref in cases(ms):
        r = {"K": k, "N": n, "bits": bits, "group": g, "M": m,
             "ours_graph_us": graph_time_us(ours, 20), "ours_eager_us": event_time_us(ours, 50)[0],
             "ours_host_us": host_us(ours),
             "ref_graph_us": graph_time_us(ref, 20), "ref_eager_us": event_time_us(ref, 50)[0],
             "ref_host_us": host_us(ref)}
        rows.append(r)
        print(f"{k:6d} {n:6d} {'int%d g%s' % (bits, g or 'ch'):>9} {m:4d} | "
              f"{r['ours_graph_us']:10.1f} {r['ours_eager_us']:7.1f} {r['ours_host_us']:7.1f} | "
              f"{r['ref_graph_us']:10.1f} {r['ref_eager_us']:7.1f} {r['ref_host_us']:7.1f} | "
              f"{r['ref_graph_us'] / r['ours_graph_us']:7.2f} {r['ref_eager_us'] / r['ours_eager_us']:7.2f}",
              flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for k, n, bits, g, m in [(4096, 4096, 4, 128, 64), (8192, 8192, 4, 128, 64),
                                 (8192, 28672, 4, 128, 256), (28672, 8192, 8, 0, 128)]:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q, s = pg.quantize_weight(w, bits=bits, group_size=g or None)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                pg.mixed_linear(x, q, s, bits=bits, group_size=g or None)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    pg.mixed_linear(x, q, s, bits=bits, group_size=g or None)
                torch.cuda.synchronize()
            print(f"\nkernels of 10 calls, ({k}, {n}) int{bits} g{g or 'ch'} M={m}:")
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
                    t = getattr(e, "self_device_time_total", 0)
                    if t > 0:
                        print(f"  {t / e.count:8.2f} us x {e.count:3d}  {e.key[:110]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

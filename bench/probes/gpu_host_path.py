"""The host's time per call on the sm_90 CUTLASS paths, against F.linear's (runs 49b and 49c).

Eager calls of the CUTLASS kernels (mixed-input at M > 32, dense bf16 `gemm`) spent 27–43 µs
of host time per call in run 27, against 14–20 µs for the small-M kernel and 16–17 µs for
bf16 F.linear. Per case, best of the rounds: host µs per call (400 calls enqueued without a
sync), eager µs per call (CUDA events over 50 back-to-back calls) and graph-replay µs (the
kernels alone), and the same three for bf16 F.linear on the same shapes. An eager time near
the host time and above the graph time is host-bound.

Run 49b used this probe for an A/B in one process: the wheel then read three temporary
switches per call (PGX_TMAP_LOOKUP=each: CUTLASS's driver lookup of cuTensorMapEncodeTiled
per descriptor; PGX_SMEM_ATTR=each: the shared-memory attribute set on every call;
PGX_SCALES_COPY=1: per-channel scales transposed), and the probe set them in alternating
rounds. The switches left with that wheel; its table is in bench/GPU_NOTES.md and
bench/results/gpu_host_path_run49b.log.

    python bench/probes/gpu_host_path.py [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import copies_for, event_time_us, graph_time_us  # noqa: E402
from gpu_mid_m import host_us  # noqa: E402

# (label, K, N, M, kind): kind "int4 g128" / "int8 ch" (mixed_linear) or "gemm" (dense bf16
# pg.gemm of x [M, K] by the weight's transpose [K, N]). The M = 1 case runs the small-M
# kernel, no CUTLASS: the control.
CASES = [
    ("4096^2 int4 g128 M=64 (stream-K)", 4096, 4096, 64, "int4 g128"),
    ("4096^2 int8 ch M=64 (stream-K)", 4096, 4096, 64, "int8 ch"),
    ("4096^2 int8 ch M=1024", 4096, 4096, 1024, "int8 ch"),
    ("(4096,22016) int8 ch M=128", 4096, 22016, 128, "int8 ch"),
    ("(4096,22016) int4 g128 M=128", 4096, 22016, 128, "int4 g128"),
    ("8192^2 int4 g128 M=256", 8192, 8192, 256, "int4 g128"),
    ("gemm bf16 1024^3", 1024, 1024, 1024, "gemm"),
    ("gemm bf16 M=256 4096^2", 4096, 4096, 256, "gemm"),
    ("4096^2 int4 g128 M=1 (small-M, control)", 4096, 4096, 1, "int4 g128"),
]


def build(k: int, n: int, m: int, kind: str):
    """(ours(i), ref(i)): the case and bf16 F.linear on the same shapes, weights rotated past L2."""
    import portable_gemm as pg

    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [w] + [w.clone() for _ in range(copies_for(w.numel() * 2) - 1)]

    def ref(i=0):
        return torch.nn.functional.linear(x, ws[i % len(ws)])

    if kind == "gemm":
        bts = [t.t() for t in ws]

        def ours(i=0):
            return pg.gemm(x, bts[i % len(bts)])

        return ours, ref
    bits = 4 if kind.startswith("int4") else 8
    g = 128 if kind.endswith("g128") else None
    q, s = pg.quantize_weight(w, bits=bits, group_size=g)
    nq = copies_for(q.numel() * q.element_size() + s.numel() * s.element_size())
    qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(nq - 1)]

    def ours(i=0):
        qq, ss = qs[i % nq]
        return pg.mixed_linear(x, qq, ss, bits=bits, group_size=g)

    return ours, ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_host_path: no CUDA device", file=sys.stderr)
        return 2
    import portable_gemm as pg

    print(f"portable_gemm {pg.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"best of {args.rounds} rounds; host = CPU time per call without a sync, eager = events over "
          "back-to-back calls, graph = replay (kernels alone); µs")
    print(f"{'case':<42} | {'host':>7} {'eager':>7} {'graph':>7} | {'F.linear host':>13} {'eager':>7} {'graph':>7}")
    rows = []
    for label, k, n, m, kind in CASES:
        ours, ref = build(k, n, m, kind)
        best = {}
        for _ in range(args.rounds):
            for name, fn in (("ours", ours), ("ref", ref)):
                t = (host_us(fn), event_time_us(fn, 50, reps=3)[0], graph_time_us(fn, 20, reps=3))
                best[name] = tuple(min(a, b) for a, b in zip(best.get(name, t), t))
        (h, e, g), (rh, re_, rg) = best["ours"], best["ref"]
        print(f"{label:<42} | {h:7.1f} {e:7.1f} {g:7.1f} | {rh:13.1f} {re_:7.1f} {rg:7.1f}", flush=True)
        rows.append({"case": label, "K": k, "N": n, "M": m, "kind": kind,
                     "host_us": h, "eager_us": e, "graph_us": g,
                     "flinear_us": {"host": rh, "eager": re_, "graph": rg}})
        del ours, ref
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

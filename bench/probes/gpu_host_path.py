"""The host's time per call on the sm_90 CUTLASS paths, and what each part of it costs (run 49).

Eager calls of the CUTLASS kernels (mixed-input at M > 32, dense bf16 `gemm`) spent 27–43 µs
of host time per call in run 27, against 14–20 µs for the small-M kernel and 16–17 µs for
bf16 F.linear. This probe times, in one process and in alternating rounds, each case under
the library's temporary A/B switches of run 49 (read per call), so each setting is compared
on the same inputs and the same host state:
- `old`: CUTLASS's per-call driver lookup of cuTensorMapEncodeTiled (PGX_TMAP_LOOKUP=each),
  the shared-memory attribute set on every call (PGX_SMEM_ATTR=each), and per-channel scales
  transposed into the workspace (PGX_SCALES_COPY=1): the shipped behaviour before run 49;
- `tmap`: only the driver lookup cached;
- `smem`: the lookup cached and the attribute set once;
- `new`: all three (per-channel scales read as stored).

Per case and setting: host µs per call (400 calls enqueued without a sync, best of the
rounds), eager µs per call (CUDA events over 50 back-to-back calls, best of the rounds) and
graph-replay µs (the kernels alone). The outputs of every setting are compared with `new`'s.

    python bench/probes/gpu_host_path.py [--rounds 3] [--json FILE]

The switches existed only in the wheel of run 49b (bench/GPU_NOTES.md has their form; the
tensor-map part was not kept). On a wheel without them every setting runs the shipped code,
so the columns differ only by noise, and the probe still gives the host / eager / graph time
of each case against F.linear's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import copies_for, event_time_us, graph_time_us  # noqa: E402
from gpu_mid_m import host_us  # noqa: E402

SETTINGS = {
    "old": {"PGX_TMAP_LOOKUP": "each", "PGX_SMEM_ATTR": "each", "PGX_SCALES_COPY": "1"},
    "tmap": {"PGX_SMEM_ATTR": "each", "PGX_SCALES_COPY": "1"},
    "smem": {"PGX_SCALES_COPY": "1"},
    "new": {},
}
SWITCHES = ("PGX_TMAP_LOOKUP", "PGX_SMEM_ATTR", "PGX_SCALES_COPY")

# (label, K, N, M, kind): kind "int4 g128" / "int8 ch" (mixed_linear), "gemm" (dense bf16
# pg.gemm of x [M, K] by the weight's transpose [K, N]), "small" (M <= 16: no CUTLASS, control).
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


def apply(setting: str) -> None:
    for k in SWITCHES:
        os.environ.pop(k, None)
    os.environ.update(SETTINGS[setting])


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
    print(f"best of {args.rounds} alternating rounds; host = CPU time per call without a sync, "
          "eager = events over back-to-back calls, graph = replay (kernels alone); µs")
    names = list(SETTINGS)
    head = " | ".join(f"{'host ' + s:>10}" for s in names)
    print(f"{'case':<42} | {head} | {'eager old':>9} {'eager new':>9} | {'graph old':>9} {'graph new':>9} "
          f"| {'F.linear host/eager/graph':>25} | max diff")
    rows = []
    for label, k, n, m, kind in CASES:
        ours, ref = build(k, n, m, kind)
        host = {s: float("inf") for s in names}
        eager = {s: float("inf") for s in names}
        graph = {s: float("inf") for s in names}
        outs = {}
        for _ in range(args.rounds):
            for s in names:
                apply(s)
                host[s] = min(host[s], host_us(ours))
                eager[s] = min(eager[s], event_time_us(ours, 50, reps=3)[0])
                if s in ("old", "new"):
                    graph[s] = min(graph[s], graph_time_us(ours, 20, reps=3))
                outs[s] = ours().float()
        apply("new")
        r = (host_us(ref), event_time_us(ref, 50, reps=3)[0], graph_time_us(ref, 20, reps=3))
        scale = outs["new"].abs().max().item() or 1.0
        diff = max((outs[s] - outs["new"]).abs().max().item() for s in names) / scale
        print(f"{label:<42} | " + " | ".join(f"{host[s]:10.1f}" for s in names) +
              f" | {eager['old']:9.1f} {eager['new']:9.1f} | {graph['old']:9.1f} {graph['new']:9.1f} "
              f"| {r[0]:7.1f} {r[1]:8.1f} {r[2]:8.1f} | {diff:.1e}", flush=True)
        rows.append({"case": label, "K": k, "N": n, "M": m, "kind": kind, "host_us": host,
                     "eager_us": eager, "graph_us": {s: graph[s] for s in ("old", "new")},
                     "flinear_us": {"host": r[0], "eager": r[1], "graph": r[2]}, "max_rel_diff": diff})
        del ours, ref
        torch.cuda.empty_cache()
    for k in SWITCHES:
        os.environ.pop(k, None)
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU benchmark (H200 and other CUDA GPUs): every result is reported as a ratio against a
reference measured in the same process, and against the machine's own measured ceilings.

Ceilings (measured first): device-to-device copy bandwidth (bytes read + written) and
cuBLAS bf16 8192^3. Weight-only: (K, N) Llama shapes x M, int4/int8, per channel and group 128,
vs bf16 F.linear (cuBLAS) and torch._weight_int4pack_mm; reports us, TB/s of weight read,
ratios; plain launches and CUDA-graph replay. Dense: squares and Llama shapes vs torch.matmul.
Weights rotate over copies larger than L2; inputs are random (never zeros).

    python bench/gpu_bench.py --out DIR [--quick]
Writes DIR/gpu_bench.json, DIR/gpu_bench.md and DIR/gpu_bench.png; prints the tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import portable_gemm as pg

WEIGHT_SHAPES = [(4096, 4096), (4096, 12288), (4096, 22016), (11008, 4096), (8192, 8192),
                 (8192, 28672), (28672, 8192)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
SCHEMES = [(4, 128), (4, None), (8, None), (8, 128)]
L2_BYTES = 60 * 2**20


def event_time_us(fn, iters: int, reps: int = 7) -> tuple[float, float]:
    """Median and spread (max-min) of per-call time over `reps` timed loops of `iters` calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times), max(times) - min(times)


def graph_time_us(fn, iters: int, reps: int = 7) -> float:
    """Per-call time of `iters` calls captured in one CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(iters):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def ceilings() -> dict:
    n = 2**30  # 2 GiB of bf16 read + 2 GiB written
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t, _ = event_time_us(lambda i=0: dst.copy_(src), iters=5)
    copy_tbs = 2 * src.numel() * 2 / (t * 1e-6) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t, _ = event_time_us(lambda i=0: a @ b, iters=10)
    mm_tflops = 2 * 8192**3 / (t * 1e-6) / 1e12
    return {"copy_TBps": copy_tbs, "cublas_bf16_8192_TFLOPs": mm_tflops}


def copies_for(nbytes: int) -> int:
    return max(2, min(16, -(-4 * L2_BYTES // max(nbytes, 1))))


def int4pack_reference(w_bf16: torch.Tensor, group: int):
    """torch._weight_int4pack_mm on a weight quantised torch's way (tinygemm layout)."""
    try:
        n, k = w_bf16.shape
        wg = w_bf16.float().reshape(n, k // group, group)
        scale = wg.abs().amax(-1, keepdim=True).clamp_min(1e-6) / 7
        q = (wg / scale).round().clamp(-8, 7).to(torch.int32).reshape(n, k) + 8
        packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        packed = torch._convert_weight_to_int4pack(packed_u8, 8)
        sz = torch.stack([scale.squeeze(-1), torch.zeros_like(scale.squeeze(-1))], -1)  # [n, G, 2]
        sz = sz.transpose(0, 1).contiguous().to(torch.bfloat16)  # [G, n, 2]
        return lambda x: torch._weight_int4pack_mm(x, packed, group, sz)
    except Exception as e:  # not every torch/GPU has it; reported as n/a
        print(f"  (torch._weight_int4pack_mm unavailable: {type(e).__name__}: {str(e)[:80]})")
        return None


def bench_weight_only(quick: bool, ceil: dict) -> list[dict]:
    rows = []
    shapes = WEIGHT_SHAPES[:1] + WEIGHT_SHAPES[4:5] + WEIGHT_SHAPES[6:] if quick else WEIGHT_SHAPES
    ms = [1, 16, 256, 4096] if quick else MS
    for k, n in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        nw = copies_for(n * k * 2)
        w_copies = [w] + [w.clone() for _ in range(min(nw, 4) - 1)]
        for bits, group in SCHEMES:
            q, s = pg.quantize_weight(w, bits=bits, group_size=group)
            wbytes = q.numel() * q.element_size() + s.numel() * s.element_size()
            nq = copies_for(wbytes)
            qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(nq - 1)]
            ref4 = int4pack_reference(w, 128) if (bits, group) == (4, 128) else None
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                iters = 50 if m <= 256 else 10

                def ours(i=0):
                    qq, ss = qs[i % nq]
                    return pg.mixed_linear(x, qq, ss, bits=bits, group_size=group)

                def cublas(i=0):
                    return F.linear(x, w_copies[i % len(w_copies)])

                t_ours, spread = event_time_us(ours, iters)
                t_ref, _ = event_time_us(cublas, iters)
                t_graph = graph_time_us(ours, 20) if m <= 16 else None
                t_i4 = event_time_us(lambda i=0: ref4(x), iters)[0] if ref4 and m <= 1024 else None
                tbs = wbytes / (t_ours * 1e-6) / 1e12
                rows.append({
                    "K": k, "N": n, "M": m, "bits": bits, "group": group or 0,
                    "ours_us": t_ours, "ours_spread_us": spread, "ours_graph_us": t_graph,
                    "linear_bf16_us": t_ref, "int4pack_us": t_i4,
                    "weight_TBps": tbs, "frac_of_copy_bw": tbs / ceil["copy_TBps"],
                    "speedup_vs_bf16": t_ref / t_ours,
                    "speedup_vs_int4pack": (t_i4 / t_ours) if t_i4 else None,
                })
                r = rows[-1]
                print(f"  K={k:<6} N={n:<6} int{bits} g{group or 'ch':<4} M={m:<5} ours {t_ours:8.1f} us "
                      f"({tbs:5.2f} TB/s, {r['frac_of_copy_bw']:.0%} of copy)  bf16 {t_ref:8.1f} us  "
                      f"x{r['speedup_vs_bf16']:.2f}" + (f"  int4pack {t_i4:7.1f} us" if t_i4 else ""), flush=True)
            del qs
        del w_copies
        torch.cuda.empty_cache()
    return rows


def bench_dense(quick: bool, ceil: dict) -> list[dict]:
    rows = []
    torch.backends.cuda.matmul.allow_tf32 = False
    # Squares with b row-major [K, N]; the Llama shapes as nn.Linear has them, b = weight.t()
    # of a [N, K] weight (K contiguous): both B layouts of the kernels are timed.
    sizes = [(s, s, s, "row") for s in ((2048, 8192) if quick else (1024, 2048, 4096, 8192))]
    if not quick:
        sizes += [(4096, k, n, "weight.t") for k, n in WEIGHT_SHAPES]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m, k, n, b_layout in sizes:
            if dtype == torch.float32 and m * k * n > 4096**3:
                continue
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            if b_layout == "row":
                b = torch.randn(k, n, device="cuda", dtype=dtype)
            else:
                b = torch.randn(n, k, device="cuda", dtype=dtype).t()
            iters = 5 if m * k * n >= 4096**3 else 20
            t_ours, spread = event_time_us(lambda i=0: pg.gemm(a, b), iters)
            t_ref, _ = event_time_us(lambda i=0: torch.matmul(a, b), iters)
            tf = 2 * m * n * k / (t_ours * 1e-6) / 1e12
            rows.append({"dtype": str(dtype)[6:], "M": m, "K": k, "N": n, "b": b_layout, "ours_us": t_ours,
                         "ours_spread_us": spread, "torch_us": t_ref, "ours_TFLOPs": tf,
                         "ratio_vs_torch": t_ref / t_ours})
            print(f"  {str(dtype)[6:]:<8} {m}x{k}x{n} b={b_layout:<8}: ours {t_ours:9.1f} us ({tf:6.1f} TFLOP/s)  "
                  f"torch {t_ref:9.1f} us  ratio {t_ref / t_ours:.2f}", flush=True)
    return rows


def plot(rows: list[dict], ceil: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({(r["K"], r["N"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.8), sharey=True, squeeze=False)
    for ax, (k, n) in zip(axes[0], shapes):
        for bits, group in SCHEMES:
            rs = [r for r in rows if (r["K"], r["N"], r["bits"], r["group"]) == (k, n, bits, group or 0)]
            ax.plot([r["M"] for r in rs], [r["weight_TBps"] for r in rs], marker="o", label=f"ours int{bits} g{group or 'ch'}")
        rs = [r for r in rows if (r["K"], r["N"], r["bits"], r["group"]) == (k, n, 8, 0)]
        ax.plot([r["M"] for r in rs], [k * n * 2 / (r["linear_bf16_us"] * 1e-6) / 1e12 for r in rs],
                "k--", label="bf16 F.linear (cuBLAS)")
        ax.axhline(ceil["copy_TBps"], color="r", lw=1, label="measured copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"K={k}, N={n}")
        ax.set_xlabel("M")
    axes[0][0].set_ylabel("weight bytes read / time (TB/s)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (fits a short device call)")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--skip-weight-only", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    info = pg.info()
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "target": info["target"], "stream_api": info["features"].get("stream_api"),
            "commit": os.environ.get("PG_COMMIT", "unknown")}
    print("gpu_bench:", json.dumps(meta))
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, cuBLAS bf16 8192^3 {ceil['cublas_bf16_8192_TFLOPs']:.0f} TFLOP/s")
    wo = [] if args.skip_weight_only else (print("weight-only (bf16 activations):")
                                           or bench_weight_only(args.quick, ceil))
    dense = [] if args.skip_dense else (print("dense:") or bench_dense(args.quick, ceil))
    result = {"meta": meta, "ceilings": ceil, "weight_only": wo, "dense": dense}
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1))
    if wo:
        plot(wo, ceil, out / "gpu_bench.png")
    # Names only: the output folder is a path of the machine it ran on.
    print("wrote gpu_bench.json" + (" and gpu_bench.png" if wo else "") + " in the --out folder")
    return 0


if __name__ == "__main__":
    sys.exit(main())

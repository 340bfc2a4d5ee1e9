"""The README's at-a-glance table of weight-only speed, computed from the committed results.

Per range of M: the kernel that runs and the range over the issues' Llama shapes of
- on the H200 (bench/results/gpu_bench_final.json): ours against bf16 F.linear in the same
  process, CUDA-graph replay where the bench has it (M <= 1024), eager above; int4 and int8,
  each per channel and g128;
- on the CPU (bench/results/cpu_bench_zen5.json): ours against torch's own weight-only
  kernels and, where the bench has it (M >= 64), bf16 F.linear; int4 g128 and int8 per
  channel.
tests/test_bench_tables.py checks that the README holds exactly this table.

    python bench/glance.py        # prints the table
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GPU_JSON, CPU_JSON = RESULTS / "gpu_bench_final.json", RESULTS / "cpu_bench_zen5.json"

# (first M, last M, H200 kernel, CPU kernel on AVX512-BF16 without AMX)
BUCKETS = [
    (1, 8, "tensor-core GEMV, 1 x tile", "nibble block / tile path"),
    (9, 16, "the same, 2 x tiles", "tile path"),
    (17, 32, "GEMV (int4: 2 slices of 16 rows, int8: 4 x tiles); from 48 MiB of weight (not int4 g128), CUTLASS 64-wide", "tile path"),
    (33, 64, "GEMV up to 16 MiB of weight (int4: slices of 16 rows, int8: 4 x tiles in slices of 32); "
     "above, CUTLASS 64-wide", "GEMM (int4) / tile path (int8)"),
    (65, 128, "CUTLASS mixed-input, 128-wide", "vdpbf16ps GEMM"),
    (129, 256, "the same, 128- or 256-wide", "vdpbf16ps GEMM"),
    (1024, 1 << 30, "the same, 256-wide", "vdpbf16ps GEMM"),
]


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}×" if values else ""


def _pair(a: list[float], b: list[float]) -> str:
    return f"{_span(a)} / {_span(b)}" if a and b else ""


def _gpu_ratio(r: dict) -> float:
    if r.get("ours_graph_us") and r.get("linear_bf16_graph_us"):
        return r["linear_bf16_graph_us"] / r["ours_graph_us"]
    return r["speedup_vs_bf16"]


def _cpu_ratios(rows: list[dict], bits: int, group: int, key: str) -> list[float]:
    return [r[key] for r in rows if (r["bits"], r["group"] or 0) == (bits, group) and r.get(key)]


def table(gpu: dict, cpu: dict) -> str:
    lines = ["| M | H200 kernel | int4 / int8 vs bf16 F.linear | CPU kernel | "
             "int4 / int8 vs torch's kernel | vs bf16 F.linear |",
             "|---|---|---|---|---|---|"]
    for lo, hi, gpu_kernel, cpu_kernel in BUCKETS:
        g = [r for r in gpu["weight_only"] if lo <= r["M"] <= hi]
        c = [r for r in cpu["weight_only"] if lo <= r["M"] <= hi]
        gpu_cell = _pair([_gpu_ratio(r) for r in g if r["bits"] == 4], [_gpu_ratio(r) for r in g if r["bits"] == 8])
        torch_cell, linear_cell = (
            _pair(_cpu_ratios(c, 4, 128, key), _cpu_ratios(c, 8, 0, key))
            for key in ("ratio_vs_torch_weight_only", "ratio_vs_linear_bf16"))
        m = f"{lo}–{hi}" if hi < 1 << 30 else f"≥ {lo}"
        lines.append(f"| {m} | {gpu_kernel} | {gpu_cell} | {cpu_kernel} | {torch_cell} | {linear_cell} |")
    return "\n".join(lines) + "\n"


def committed_table() -> str:
    return table(json.loads(GPU_JSON.read_text()), json.loads(CPU_JSON.read_text()))


if __name__ == "__main__":
    print(committed_table(), end="")

"""CPU benchmark: portable_gemm against torch's own CPU kernels, side by side in one process,
same inputs, same threads. Every figure is a ratio against the reference measured in the
same run; weight-only results are also reported as GB/s of weight read against this
machine's read bandwidth, measured in the same run.

    python bench/cpu_bench.py [--quick] [--threads 2] [--out bench/results]

Writes OUT/cpu_bench.json, OUT/cpu_bench.md (the tables, with date, commit and CPU flags)
and OUT/cpu_bench.png (GB/s of weight read against M, ours vs torch).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import portable_gemm as pg
import target_rounds  # bench/target_rounds.py, next to this file

DENSE_SIZES = [256, 512, 1024, 2048, 4096]
WEIGHT_SHAPES = [(4096, 4096), (4096, 12288), (4096, 22016), (11008, 4096), (8192, 8192), (8192, 28672)]
MS = [1, 2, 4, 8, 16, 32, 64, 256]
# The section of bench/CPU_NOTES.md that describes the kernels this version of the bench was
# written for; each run records it, so a table's bound texts name what held that run's code.
NOTES_SECTION = 73


def sysfs_caches() -> list[tuple[str, str, str]]:
    """(level, type, size as sysfs writes it, e.g. "2048K") of each cache of cpu0; none
    where sysfs has no cache directory."""
    caches = []
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            caches.append(tuple((idx / f).read_text().strip() for f in ("level", "type", "size")))
        except OSError:
            pass
    return caches


def llc_bytes() -> int:
    """The largest cache this CPU reports (sysfs), or 0 where it reports none."""
    best = 0
    for _, _, text in sysfs_caches():
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            pass
    return best


# Every implementation rotates its weights over more than this: 128 MiB, or twice the
# last-level cache where that is larger (a Xeon VM reports 480 MiB of L3; with 128 MiB its
# int8 M = 1 rows read at 105-107 % of the 1 GiB read probe, from the cache).
LLC_BYTES = max(128 * 2**20, 2 * llc_bytes())
LONG_CALL_S = 2.0  # a call this long is timed once per round (see timeit)
ONCE_CALL_S = 30.0  # a call this long is timed in the first round only (see in_rounds)


def timeit(fn, min_time: float = 0.3, reps: int = 5, warm: bool = True) -> tuple[float, float]:
    """Median and spread (max - min) in seconds of one call; each rep runs >= min_time/reps.
    A call of LONG_CALL_S or more (after the warm-up call, which `warm=False` leaves out) is
    that one sample: torch's bf16 matmul on a CPU without AVX512-BF16 takes seconds per call
    (2.8 s at 1024^3 on an AVX2 machine), and 5 more reps in each of 3 rounds would be most
    of the run. A warm-up call of ONCE_CALL_S or more is the sample itself: against such a
    call, what a first call costs besides (allocations, lazy set-up) is lost in the noise."""
    if warm:
        t0 = time.perf_counter()
        fn(0)
        first = time.perf_counter() - t0
        if first >= ONCE_CALL_S:
            return first, 0.0
    t0 = time.perf_counter()
    fn(1)
    one = max(time.perf_counter() - t0, 1e-6)
    if one >= LONG_CALL_S:
        return one, 0.0
    inner = max(1, int(min_time / reps / one))
    samples = []
    for r in range(reps):
        t0 = time.perf_counter()
        for i in range(inner):
            fn(r * inner + i)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples), max(samples) - min(samples)


_PROBE_BUF: torch.Tensor | None = None


def read_bandwidth(min_time: float = 1.0) -> float:
    """GB/s of a plain reduction over 1 GiB (far larger than the caches), same threads."""
    global _PROBE_BUF
    if _PROBE_BUF is None:
        _PROBE_BUF = torch.rand(2**28)  # 1 GiB of float32, kept for the probes next to each case
    t, _ = timeit(lambda i: _PROBE_BUF.sum(), min_time=min_time)
    return _PROBE_BUF.numel() * 4 / t / 1e9


def in_rounds(fns: dict, rounds: int = 3, min_time: float = 0.1, probe: bool = False,
              reps: int = 3) -> dict[str, list[float]]:
    """Each of fns (name -> fn(i)) timed in turn, after a read-bandwidth probe when asked, for
    `rounds` rounds: name -> seconds per call in each round (median of `reps`; "probe" ->
    GB/s). The VM's neighbours come and go within seconds, and its read bandwidth and speed
    move with them (bench/CPU_NOTES.md, sections 16 and 17): a ratio or share taken within
    one round sees every side under the same load.

    A call of LONG_CALL_S or more is not warmed up again after the first round, and one of
    ONCE_CALL_S or more is not timed again at all: its list holds the first round's sample
    only, so per_round takes the first round. On an AVX2 Zen 1 torch's bf16 matmul took
    140 s per 2048^3 call (bench/CPU_NOTES.md 52): 3 rounds of a warm-up and a timed call
    were 14 of the quick run's 18 minutes, and 4096^3 would take hours."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    if probe:
        out["probe"] = []
    for r in range(rounds):
        if probe:
            out["probe"].append(read_bandwidth(min_time=min_time))
        for name, fn in fns.items():
            if r > 0 and out[name][0] >= ONCE_CALL_S:
                continue
            warm = r == 0 or out[name][0] < LONG_CALL_S
            out[name].append(timeit(fn, min_time=min_time, reps=reps, warm=warm)[0])
    return out


def per_round(a: list[float], b: list[float]) -> float:
    """Median over the rounds both were timed in (see in_rounds) of a / b."""
    return statistics.median(x / y for x, y in zip(a, b))


def round_shares(nbytes: int, times_s: list[float], probes_GBps: list[float]) -> list[float]:
    """(nbytes / time) / probe of each round: the share of the read bandwidth."""
    return [nbytes / t / 1e9 / p for t, p in zip(times_s, probes_GBps)]


def probe_share(nbytes: int, times_s: list[float], probes_GBps: list[float]) -> float:
    """Median over rounds of the share of the read bandwidth."""
    return statistics.median(round_shares(nbytes, times_s, probes_GBps))


def hot_rate(bits: int, group: int | None, min_time: float = 0.3) -> float:
    """GB/s of ours at M = 1 on a weight that stays in the caches (K = 4096, N = 1024: 2 MB
    of int4, 4 MB of int8): what the kernel itself can do when memory is not the limit."""
    w = (torch.randn(1024, 4096) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, 4096).to(torch.bfloat16)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    t, _ = timeit(lambda i: pg.mixed_linear(x, q, s, bits=bits, group_size=group), min_time=min_time)
    return (q.numel() + s.numel() * s.element_size()) / t / 1e9


def cpu_flags() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
        keep = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
        return " ".join(f for f in keep if f" {f}" in flags)
    except (OSError, IndexError):
        return platform.machine()


def cpu_model() -> str:
    """The CPU's name with its family and model (VMs often show only "AMD EPYC"), and its
    per-core L2 and shared L3 as Linux reports them: which core a table was measured on."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
        field = dict((k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in info.splitlines()))
        cache = ", ".join(f"L{level} {size}" for level, kind, size in sysfs_caches()
                          if level in ("2", "3") and kind in ("Unified", "Data"))
        return (f"{field.get('model name', platform.processor())} (family {field.get('cpu family', '?')}, "
                f"model {field.get('model', '?')}" + (f"; {cache}" if cache else "") + ")")
    except (OSError, ValueError):
        return platform.processor() or platform.machine()


def bench_dense(quick: bool) -> list[dict]:
    rows = []
    sizes = [1024, 2048] if quick else DENSE_SIZES
    for dtype in (torch.float32, torch.bfloat16):
        for s in sizes:
            a, b = torch.randn(s, s).to(dtype), torch.randn(s, s).to(dtype)
            R = in_rounds({"ours": lambda i: pg.gemm(a, b), "ref": lambda i: torch.matmul(a, b)},
                          min_time=0.3, reps=5)
            t_ours, t_ref, ratio = statistics.median(R["ours"]), statistics.median(R["ref"]), per_round(R["ref"], R["ours"])
            sp = max(R["ours"]) - min(R["ours"])
            gf = 2 * s**3 / t_ours / 1e9
            paired = min(len(R["ours"]), len(R["ref"]))
            row = {"dtype": str(dtype)[6:], "size": s, "ours_ms": t_ours * 1e3, "spread_ms": sp * 1e3,
                   "torch_ms": t_ref * 1e3, "ours_GFLOPs": gf, "ratio": ratio}
            if paired < max(len(R["ours"]), len(R["ref"])):
                row["rounds"] = paired
            rows.append(row)
            print(f"  gemm {str(dtype)[6:]:<8} {s:>5}^3  ours {t_ours * 1e3:9.2f} ms ({gf:7.1f} GFLOP/s)  "
                  f"torch.matmul {t_ref * 1e3:9.2f} ms  ratio {ratio:.2f} "
                  + (f"(median of {paired} alternating rounds)" if paired > 1 else
                     f"(first round only: a call took {max(t_ours, t_ref):.0f} s)"), flush=True)
    return rows


def rotation(nbytes: int) -> int:
    """Copies of a weight needed so that cycling through them streams from DRAM."""
    return max(1, -(-LLC_BYTES // max(nbytes, 1)))


def torch_int8(w: torch.Tensor):
    """torch's own weight-only int8 path (per-channel) on the same weight, rotated like ours."""
    q, s = pg.quantize_weight(w, bits=8)
    copies = [(q, s)] + [(q.clone(), s.clone()) for _ in range(rotation(q.numel()) - 1)]
    return lambda x, i: torch._weight_int8pack_mm(x, *copies[i % len(copies)])


def torch_int4(w: torch.Tensor, group: int):
    """torch._weight_int4pack_mm_for_cpu (tinygemm layout: unsigned nibbles + scales/zeros)."""
    try:
        n, k = w.shape
        wg = w.float().reshape(n, k // group, group)
        scale = wg.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 7
        q = ((wg / scale).round().clamp(-8, 7) + 8).to(torch.int32).reshape(n, k)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([scale.squeeze(-1), torch.zeros_like(scale.squeeze(-1))], -1)
        sz = sz.transpose(0, 1).contiguous().to(w.dtype)
        copies = [packed] + [packed.clone() for _ in range(rotation(packed.numel() * packed.element_size()) - 1)]
        return lambda x, i: torch._weight_int4pack_mm_for_cpu(x, copies[i % len(copies)], group, sz)
    except (RuntimeError, AttributeError) as e:
        print(f"  (torch int4 CPU reference unavailable: {str(e)[:80]})")
        return None


def bench_weight_only(quick: bool, bw: float) -> list[dict]:
    rows = []
    shapes = [(4096, 4096), (8192, 8192)] if quick else WEIGHT_SHAPES
    ms = [1, 16, 256] if quick else MS
    for k, n in shapes:
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        ws = [w] + [w.clone() for _ in range(rotation(w.numel() * 2) - 1)]
        for bits, group in ((8, None), (4, 128)):
            q, s = pg.quantize_weight(w, bits=bits, group_size=group)
            wbytes = q.numel() + s.numel() * s.element_size()
            copies = rotation(wbytes)
            qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
            ref = torch_int8(w) if bits == 8 else torch_int4(w, 128)
            for m in ms:
                x = torch.randn(m, k).to(torch.bfloat16)
                fns = {"ours": lambda i: pg.mixed_linear(x, *qs[i % copies], bits=bits, group_size=group)}
                if ref:
                    fns["ref"] = lambda i: ref(x, i)
                if m >= 64 or quick:
                    fns["lin"] = lambda i: F.linear(x, ws[i % len(ws)])
                if m == 256:  # our bf16 GEMM on the same shape: what bounds this path
                    fns["gemm"] = lambda i: pg.gemm(x, ws[i % len(ws)].t())
                extra = {}
                if m == 1:  # the kernel's own rate right next to the row (the VM's speed moves too)
                    extra["hot_GBps"] = hot_rate(bits, group, min_time=0.2)
                # Bandwidth-bound rows (M <= 16) alternate with their own read-bandwidth probes.
                R = in_rounds(fns, probe=m <= 16)
                t_ours = statistics.median(R["ours"])
                if m <= 16:
                    probe, frac = statistics.median(R["probe"]), probe_share(wbytes, R["ours"], R["probe"])
                    extra["read_GBps_rounds"] = R["probe"]
                else:
                    probe, frac = bw, wbytes / t_ours / 1e9 / bw
                for name, key in (("ours", "ours_ms_rounds"), ("ref", "torch_weight_only_ms_rounds"),
                                  ("lin", "linear_bf16_ms_rounds"), ("gemm", "gemm_bf16_ms_rounds")):
                    if name in R:
                        extra[key] = [t * 1e3 for t in R[name]]
                t_ref = statistics.median(R["ref"]) if "ref" in R else None
                t_lin = statistics.median(R["lin"]) if "lin" in R else None
                if "gemm" in R:
                    extra["gemm_bf16_ms"] = statistics.median(R["gemm"]) * 1e3
                gbs = wbytes / t_ours / 1e9
                rows.append({"K": k, "N": n, "M": m, "bits": bits, "group": group or 0,
                             "ours_ms": t_ours * 1e3, "spread_ms": (max(R["ours"]) - min(R["ours"])) * 1e3,
                             "torch_weight_only_ms": t_ref * 1e3 if t_ref else None,
                             "linear_bf16_ms": t_lin * 1e3 if t_lin else None,
                             "weight_GBps": gbs, "read_GBps_probe": probe, "frac_of_read_bw": frac,
                             "ratio_vs_torch_weight_only": per_round(R["ref"], R["ours"]) if t_ref else None,
                             "ratio_vs_linear_bf16": per_round(R["lin"], R["ours"]) if t_lin else None,
                             "weight_bytes": wbytes, **extra})
                r = rows[-1]
                print(f"  int{bits} g{group or 'ch':<4} K={k:<5} N={n:<5} M={m:<4} ours {t_ours * 1e3:8.2f} ms "
                      f"{gbs:6.1f} GB/s ({r['frac_of_read_bw']:.0%} of read bw {probe:.1f})"
                      + (f"  torch {t_ref * 1e3:8.2f} ms x{r['ratio_vs_torch_weight_only']:.2f}" if t_ref else "")
                      + (f"  bf16 F.linear x{r['ratio_vs_linear_bf16']:.2f}" if t_lin else ""), flush=True)
            del qs
    return rows


def markdown(meta: dict, dense: list[dict], wo: list[dict], targets: dict | None = None) -> str:
    lines = [f"# CPU benchmark — {meta['date']}", "",
             f"commit `{meta['commit']}`, torch {meta['torch']}, target {meta['target']}, "
             f"{meta['threads']} threads, ISA {meta['isa']}, CPU flags: {meta['cpu_flags']}"
             + (f", CPU: {meta['cpu']}" if "cpu" in meta else "")
             + (f"; AVX2 dequantise-once path: {meta['avx2_dq']}" if meta.get("avx2_dq") else ""), "",
             f"Measured read bandwidth (sum over 1 GiB, same threads): **{meta['read_GBps']:.1f} GB/s** at the "
             f"start{probe_note(wo)}. Rows with M <= 16 alternate with a read-bandwidth probe for 3 rounds; their "
             "share of the read bandwidth is the median of the per-round shares."
             + (f" Each implementation cycles through copies of its weights of at least "
                f"{meta['rotation_bytes'] / 2**20:.0f} MiB in all (twice the largest cache the CPU reports, "
                "128 MiB at least)." if "rotation_bytes" in meta else ""), "",
             "## Goals", "", *goals(meta, dense, wo, targets), "",
             "## Dense gemm vs torch.matmul (ratio > 1: we are faster)", ""]
    if dense:
        lines += ["| dtype | size | ours ms | torch ms | ours GFLOP/s | ratio |", "|---|---|---|---|---|---|"]
    else:
        lines.append("Not measured in this run (`--skip-dense`).")
    for r in dense:
        lines.append(f"| {r['dtype']} | {r['size']} | {r['ours_ms']:.2f} | {r['torch_ms']:.2f} | "
                     f"{r['ours_GFLOPs']:.1f} | {r['ratio']:.2f}{'*' if 'rounds' in r else ''} |")
    if any("rounds" in r for r in dense):
        lines += ["", f"\\* a call took {ONCE_CALL_S:.0f} s or more: this size was timed in the first round "
                  "only, so the ratio is that round's."]
    lines += ["", "## Weight-only mixed_linear (bf16 activations)", "",
              "| scheme | K | N | M | ours ms | GB/s | of read bw | vs torch weight-only | vs bf16 F.linear |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in wo:
        vt = f"{r['ratio_vs_torch_weight_only']:.2f}" if r["ratio_vs_torch_weight_only"] else "n/a"
        vl = f"{r['ratio_vs_linear_bf16']:.2f}" if r["ratio_vs_linear_bf16"] else ""
        lines.append(f"| int{r['bits']} g{r['group'] or 'ch'} | {r['K']} | {r['N']} | {r['M']} | {r['ours_ms']:.2f} | "
                     f"{r['weight_GBps']:.1f} | {r['frac_of_read_bw']:.0%} | {vt} | {vl} |")
    return "\n".join(lines) + "\n"


def probe_note(wo: list[dict]) -> str:
    probes = [r["read_GBps_probe"] for r in wo if r.get("read_GBps_probe") and r["M"] <= 16]
    return f"; {min(probes):.1f}-{max(probes):.1f} GB/s in the probes next to the M <= 16 rows" if probes else ""


def goals(meta: dict, dense: list[dict], wo: list[dict], targets: dict | None) -> list[str]:
    """Each goal of the CPU performance issue, met or not, with the measured ratio and, where
    missed, what bounds it: bytes against the read bandwidth, or the FLOPs the goal needs
    against the fastest GEMM rate, both measured in the same run."""
    out = ["| goal | measured | met | bound where missed |", "|---|---|---|---|"]
    # The compute ceiling, measured in this run: the fastest GEMM on this machine (ours or
    # torch.matmul in any dtype, bf16 F.linear, or our weight-only GEMM at M > 16; 2
    # threads). Where the CPU has a bf16 unit that is a bf16 GEMM; on AVX2-only CPUs, whose
    # torch bf16 matmul is slow, an fp32 one. A weight-only kernel at M rows does 2 M FLOPs
    # per weight, so reading weights at R GB/s needs 2 M R (int8) or 4 M R (int4) GFLOP/s.
    rates = [2 * r["size"] ** 3 / (t * 1e-3) / 1e9 for r in dense for t in (r["ours_ms"], r["torch_ms"])]
    rates += [2 * r["M"] * r["N"] * r["K"] / (r["linear_bf16_ms"] * 1e-3) / 1e9 for r in wo if r["linear_bf16_ms"]]
    rates += [2 * r["M"] * r["N"] * r["K"] / (r["ours_ms"] * 1e-3) / 1e9 for r in wo if r["M"] > 16]
    ceiling = max(rates, default=0.0)
    mac = "vdpbf16ps" if "bf16" in meta.get("isa", "") else "FMAs"  # the multiply-adds of the small-M blocks

    def row(goal, values, ok, bound=""):
        out.append(f"| {goal} | {values} | {'yes' if ok else '**no**'} | {'' if ok else bound} |")

    for dt in ("float32", "bfloat16"):
        rs = [r for r in dense if r["dtype"] == dt and r["size"] >= 1024]
        if rs:
            worst = min(r["ratio"] for r in rs)
            best_torch = max(2 * r["size"] ** 3 / (r["torch_ms"] * 1e-3) / 1e9 for r in rs)
            row(f"{dt} gemm >= 0.9x torch.matmul at 1024-4096",
                ", ".join(f"{r['size']}: {r['ratio']:.2f}x" for r in rs), worst >= 0.9,
                f"ours {max(r['ours_GFLOPs'] for r in rs):.0f} vs torch {best_torch:.0f} GFLOP/s on 2 cores"
                + (("; on AMX the tile kernel (32 x 32 of C) takes ~76-87% of the call (perf: 2048^3 before "
                    "CPU_NOTES 63's changes, 4096^3 after); it runs at the tile unit's rate (~2.9 TFLOP/s a core) "
                    "with its operands in L1 and ~1.7-1.9 in the call, where the packed A streams from L3 (a "
                    "probe: A from L2 would give ~2.2-2.4); packing and the epilogue's stores take most of the "
                    "rest, and torch's own time at 4096 moved between 44 and 51 ms over the runs of this kernel "
                    "code's notes (bench/CPU_NOTES.md 62, 63)"
                    if "amx" in meta.get("isa", "") and meta.get("notes_section", 0) >= 63 else
                    "; on AMX the tile kernel (32 x 32 of C) takes ~76% of the call at 2048, at about its "
                    "in-L1 rate (~2 TFLOP/s a core); packing A and B take ~11% and the epilogue's stores ~6% "
                    "(a perf profile; a pipelined epilogue and a prefetch of C's lines did not help, "
                    "bench/CPU_NOTES.md 62)"
                    if "amx" in meta.get("isa", "") and meta.get("notes_section", 0) >= 62 else
                    "; on AMX the tile kernel (32 x 32 of C) takes ~83% of the call at 2048 and runs at ~80% "
                    "of its in-L1 rate; the rest is packing and the bf16 stores (a perf profile, "
                    "bench/CPU_NOTES.md 49, 60)"
                    if "amx" in meta.get("isa", "") and meta.get("notes_section", 0) >= 60 else
                    "; on AMX the tile kernel (32 x 32 of C) runs at about half its in-L1 rate while its B "
                    "slivers stream from L2, and B is packed on every call (bench/CPU_NOTES.md 49)"
                    if "amx" in meta.get("isa", "") else
                    "; the micro-kernel alone runs at the vdpbf16ps peak (CPU_NOTES 9), the rest is packing "
                    "and blocking") if dt == "bfloat16" else
                   f"; against torch's fastest fp32 GEMM here as the ceiling ours runs at "
                   f"{max(r['ours_GFLOPs'] for r in rs) / best_torch:.0%} of it; the 12x32 micro-kernel alone "
                   "runs at the FMA peak (~248 GFLOP/s a core here) and takes ~92% of the call at 4096; "
                   "packing A and B take ~4.5% and the rest is its partial sums through L3 between kc blocks "
                   "(a perf profile, bench/probes/cpu_avx512_ukernel_rate.cpp, bench/CPU_NOTES.md 63)"
                   if "avx512" in meta.get("isa", "") and meta.get("notes_section", 0) >= 63 else
                   f"; against torch's fastest fp32 GEMM here as the ceiling ours runs at "
                   f"{max(r['ours_GFLOPs'] for r in rs) / best_torch:.0%} of it: the FMA rate of our "
                   f"{'12x32' if 'avx512' in meta.get('isa', '') else '6x16'} micro-kernel (cache-block and "
                   "row-chunk sweeps and a prefetch of its partial sums did not move it, bench/CPU_NOTES.md 29, 30)"))

    def gflops(r):
        return 2 * r["M"] * r["N"] * r["K"] / (r["ours_ms"] * 1e-3) / 1e9

    def needs(r, gbps):
        """GFLOP/s needed to read r's weights at gbps GB/s (2 M FLOPs per weight)."""
        return 2 * r["M"] * gbps * (2 if r["bits"] == 4 else 1)

    def flops_bound(goal, need, r, extra=""):
        """The goal's FLOP rate against the fastest GEMM of the run: the bound when it is above
        80 % of that ceiling (the same instruction stream also dequantises every weight); below,
        FLOPs are not what stops it, and the work per weight around the multiply-adds is."""
        if need > ceiling:
            return (f"FLOPs: {goal} needs {need:.0f} GFLOP/s, {need / ceiling:.1f}x the fastest GEMM measured "
                    f"here ({ceiling:.0f}){extra}; ours does {gflops(r):.0f}"
                    + ("" if extra else " while also dequantising"))
        if need > 0.8 * ceiling:
            return (f"FLOPs: {goal} needs {need:.0f} GFLOP/s, {need / ceiling:.0%} of the fastest GEMM measured "
                    f"here ({ceiling:.0f}){extra}; ours does {gflops(r):.0f}")
        # On AMX CPUs these rows run amx_linear (int4 from 3 rows, int8 from 5; mixed_linear.cpp),
        # as measured in CPU_NOTES 60 for runs of that code.
        if ("amx" in meta.get("isa", "") and meta.get("notes_section", 0) >= 60
                and r["M"] >= (3 if r["bits"] == 4 else 5)):
            how = ("amx_linear's dequantisation to bf16 and its tile steps, which overlap little "
                   "(timing-only builds, bench/CPU_NOTES.md 60)")
        else:
            how = "the dequantising instructions per weight around its multiply-adds"
        return (f"not FLOPs: {goal} needs {need:.0f} GFLOP/s, {need / ceiling:.0%} of the fastest GEMM measured "
                f"here ({ceiling:.0f}); ours does {gflops(r):.0f}, bound by {how}")

    for bits, group, name in ((8, 0, "int8"), (4, 128, "int4 g128")):
        rs = [r for r in wo if (r["bits"], r["group"]) == (bits, group)]
        m1 = [r for r in rs if r["M"] == 1]
        if m1:
            w = min(m1, key=lambda r: r["frac_of_read_bw"])
            probe, hot = w["read_GBps_probe"], w["hot_GBps"]
            bound = f"{w['weight_GBps']:.1f} GB/s vs {probe:.1f} GB/s read bandwidth next to it; 80% is {0.8 * probe:.1f}"
            if hot < 0.8 * probe:
                bound += (f", more than ours does on cache-resident weights (4096 x 1024) right after the row: "
                          f"{hot:.1f} GB/s, its own instruction throughput (dequantising ops and {mac} per weight)")
                if (bits == 4 and "bf16" in meta.get("isa", "") and "amx" not in meta.get("isa", "")
                        and meta.get("notes_section", 0) >= 68):
                    # small_block_nib at M = 1 on Zen 4, counted and timed in CPU_NOTES 66
                    bound += ("; the nibble block's loop does 12 shifts, 16 vpternlogd and 16 vdpbf16ps per 4 rows x "
                              "128 k (256 bytes) and alone takes 21-23 TSC ticks a block on one core, 14.9-16.5 "
                              "without the shifts (bench/CPU_NOTES.md 66)")
            else:
                fr = round_shares(w["weight_bytes"], [t * 1e-3 for t in w["ours_ms_rounds"]], w["read_GBps_rounds"])
                shares = ", ".join(f"{f:.0%} of {p:.1f}" for f, p in zip(fr, w["read_GBps_rounds"]))
                bound += (f"; ours does {hot:.1f} GB/s on cache-resident weights (4096 x 1024) right after the row, so "
                          f"neither that nor the probe bounds this row alone; its rounds against their probes: {shares}")
                if max(fr) - min(fr) < 0.1:
                    bound += (", steady, so it is how the kernel reads memory: 4 weight rows at a time per thread, "
                              "each a short stream, where the probe reads one long one (bench/CPU_NOTES.md sections 3 "
                              "and 17)")
                else:
                    bound += " (the VM's bandwidth moves within seconds, bench/CPU_NOTES.md section 16)"
            row(f"{name} M=1 reads weights at >= 80% of read bandwidth",
                f"worst {w['frac_of_read_bw']:.0%} ({w['K']}x{w['N']})", w["frac_of_read_bw"] >= 0.8, bound)
        small = [r for r in rs if r["M"] <= 16]
        if small:
            w = min(small, key=lambda r: r["frac_of_read_bw"])
            need = needs(w, 0.7 * (w.get("read_GBps_probe") or meta["read_GBps"]))
            row(f"{name} M<=16 reads weights at >= 70% of read bandwidth",
                f"worst {w['frac_of_read_bw']:.0%} (M={w['M']}, {w['K']}x{w['N']})", w["frac_of_read_bw"] >= 0.7,
                flops_bound(f"70% at M={w['M']}", need, w))
        refd = [r for r in rs if r["ratio_vs_torch_weight_only"]]
        if bits == 8:
            m16 = [r for r in refd if r["M"] == 16]
            if m16:
                w = min(m16, key=lambda r: r["ratio_vs_torch_weight_only"])
                need = gflops(w) * 3 / w["ratio_vs_torch_weight_only"]
                bound = flops_bound("3x", need, w, " plus the dequantisation")
                if ("bf16" in meta.get("isa", "") and "amx" not in meta.get("isa", "")
                        and meta.get("notes_section", 0) >= 68):
                    # the AVX512-BF16 tile path (tile_block): counted in CPU_NOTES 68
                    bound += ("; the tile path makes exact bf16 of each 32 weights in 5 operations (2 vpmovsxbd, "
                              "2 vcvtdq2ps, 1 vcvtne2ps2bf16) for 16 vdpbf16ps (one per row of x); without overlap "
                              "between the two, which a one-thread run matched (76% of the kernel's rate, "
                              "bench/CPU_NOTES.md 68), it reaches at most 16/21 of the vdpbf16ps rate: "
                              f"{ceiling * 16 / 21:.0f} of the fastest GEMM here")
                row("int8 M=16 >= 3x torch._weight_int8pack_mm", f"worst {w['ratio_vs_torch_weight_only']:.2f}x "
                    f"({w['K']}x{w['N']})", w["ratio_vs_torch_weight_only"] >= 3, bound)
        elif refd:
            w = min(refd, key=lambda r: r["ratio_vs_torch_weight_only"])
            row("int4 >= 1x torch._weight_int4pack_mm_for_cpu everywhere",
                f"worst {w['ratio_vs_torch_weight_only']:.2f}x (M={w['M']}, {w['K']}x{w['N']})",
                w["ratio_vs_torch_weight_only"] >= 1,
                f"{w['weight_GBps']:.1f} GB/s of weight read"
                + (f" ({w['frac_of_read_bw']:.0%} of the read probe next to it)" if w["M"] <= 16 else "")
                + f" and {gflops(w):.0f} GFLOP/s ({gflops(w) / ceiling:.0%} of the fastest GEMM here): neither "
                "bounds it; the dequantising work per weight at that M does (bench/CPU_NOTES.md 27)")
        m256 = [r for r in rs if r["M"] == 256 and r["ratio_vs_linear_bf16"]]
        if m256:
            w = min(m256, key=lambda r: r["ratio_vs_linear_bf16"])
            need = gflops(w) / w["ratio_vs_linear_bf16"]
            dense_rate = 2 * w["M"] * w["N"] * w["K"] / (w["gemm_bf16_ms"] * 1e-3) / 1e9
            if gflops(w) < dense_rate:
                why = (f"bounded by our bf16 GEMM, which does {dense_rate:.0f} on the same shape right after the row, "
                       "plus the dequantisation of the weight")
            elif "amx" in meta.get("isa", "") and meta.get("notes_section", 0) >= 62:
                # since section 62 tasks of <= 256 rows take their own blocks (1 MB of B panel)
                why = (f"more than our bf16 GEMM on the same shape ({dense_rate:.0f}; it packs 2-byte weights); "
                       "both run the same AMX tile kernel (32 x 32 of C) in blocks of 2048 k x 256 columns "
                       "that fit L2 (bench/CPU_NOTES.md 62)")
            elif "amx" in meta.get("isa", "") and meta.get("notes_section", 0) >= 61:
                # on AMX the dense path runs the bf16 GEMM's tile kernel, not the vdpbf16ps one
                why = (f"more than our bf16 GEMM on the same shape ({dense_rate:.0f}; it packs 2-byte weights); "
                       "both run the same AMX tile kernel (32 x 32 of C), which ran at ~80% of its in-L1 rate in "
                       "the bf16 GEMM's profile at 2048 (bench/CPU_NOTES.md 49, 60)")
            elif "bf16" in meta.get("isa", "") and meta.get("notes_section", 0) >= 68:  # profiled in CPU_NOTES 66, the overlap tried in 68
                why = (f"more than our bf16 GEMM on the same shape ({dense_rate:.0f}; it packs 2-byte weights); "
                       "the same vdpbf16ps micro-kernel runs at its peak, and dequantising, packing and storing "
                       "take ~7% of the time (a perf profile, int8 per channel 4096 x 22016, bench/CPU_NOTES.md "
                       "66); the packer run inside the micro-kernel's calls hid none of it (68)")
            else:  # the int8 / int4 packer reads fewer bytes than the bf16 one: the GEMM is no bound
                why = (f"more than our bf16 GEMM on the same shape ({dense_rate:.0f}; it packs 2-byte weights); "
                       "the same vdpbf16ps micro-kernel runs at its peak, and dequantising and packing take ~8% of "
                       "the time (bench/CPU_NOTES.md, 18)")
            row(f"{name} M=256 >= 1x bf16 F.linear", f"worst {w['ratio_vs_linear_bf16']:.2f}x ({w['K']}x{w['N']})",
                w["ratio_vs_linear_bf16"] >= 1,
                f"FLOPs: F.linear runs at {need:.0f} GFLOP/s (the ceiling is {ceiling:.0f}); ours {gflops(w):.0f}, "
                + why)
    if targets:
        worst = max(abs(v - 1) for v in targets["ratios"].values())
        # Each side's fastest round as well: a process can run at about half speed as a whole
        # (both sides showed it on the AMX host, bench/CPU_NOTES.md 29), which a median of
        # per-round ratios does not cancel. The verdict stays on the median.
        raw = targets["raw"]
        best = target_rounds.fastest(targets)
        worst_best = max(abs(v - 1) for v in best.values())
        # Runs before the probe reported its threading (2.9 was then always on the own pool).
        pools = {"portable_gemm_pool": "own pool", "torch_openmp": "torch's OpenMP",
                 "torch::stable::parallel_for": "torch's pool"}
        other_pool = pools.get(raw["other"][0].get("threading"), "own pool")
        default_pool = pools.get(raw["default"][0].get("threading"), "torch's pool")
        row(f"target {targets['target']} ({other_pool}) within 10% of {meta['target']} ({default_pool}); "
            f"time {targets['target']} / time {meta['target']}, median of {len(raw['other'])} "
            "alternating rounds",
            ", ".join(f"{k}: {v:.2f}x" for k, v in targets["ratios"].items())
            + "; fastest round of each side: " + ", ".join(f"{v:.2f}x" for v in best.values()),
            worst <= 0.10,
            "the two pools' scheduling of these calls (the kernels are the same code)"
            + (f"; the fastest rounds are within {worst_best:.0%}, and slow rounds of either side run at up to "
               "half speed throughout the process (the raw times in the JSON)" if worst_best <= 0.10 else ""))
    return out


TARGET_PROBE = r"""
import json, sys, time, torch, portable_gemm as pg
sys.path.insert(0, sys.argv[1])
from cpu_bench import timeit
torch.set_num_threads(int(sys.argv[2])); torch.manual_seed(0)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
ab, bb = a.bfloat16(), b.bfloat16()
w = (torch.randn(4096, 4096) * 0.02).bfloat16()
q, s = pg.quantize_weight(w, bits=8)
q4, s4 = pg.quantize_weight(w, bits=4, group_size=128)
x1, x16, x256 = (torch.randn(m, 4096).bfloat16() for m in (1, 16, 256))
t = torch.zeros(1 << 16)  # a torch op on its pool (at::parallel_for) right before ours: a model's pattern
def after_torch_op(f):
    t.add_(1.0)
    return f()
res = {"target": pg.info()["target"], "threading": pg.info()["features"]["threading"],
       "gemm f32 1024": timeit(lambda i: pg.gemm(a, b))[0],
       "gemm bf16 1024": timeit(lambda i: pg.gemm(ab, bb))[0],
       "int8 M=1 4096": timeit(lambda i: pg.mixed_linear(x1, q, s, bits=8))[0],
       "int8 M=16 4096": timeit(lambda i: pg.mixed_linear(x16, q, s, bits=8))[0],
       "int4 M=1 4096": timeit(lambda i: pg.mixed_linear(x1, q4, s4, bits=4, group_size=128))[0],
       "int4 M=256 4096": timeit(lambda i: pg.mixed_linear(x256, q4, s4, bits=4, group_size=128))[0],
       "gemm f32 1024 after a torch op": timeit(lambda i: after_torch_op(lambda: pg.gemm(a, b)))[0],
       "int4 M=1 4096 after a torch op":
           timeit(lambda i: after_torch_op(lambda: pg.mixed_linear(x1, q4, s4, bits=4, group_size=128)))[0]}
print("PROBE" + json.dumps(res))
"""


# 21, not 7: on a noisy 2-core VM single rounds read 0.63-1.85x across the cases, and the three
# 7-round windows of one 21-round run had their worst medians at 1.25x, 1.14x and 1.07x
# where the 21 rounds read 0.98-1.08x (bench/CPU_NOTES.md 75). ~10 s a round there.
TARGET_ROUNDS = 21


def compare_targets(other: str, threads: int, rounds: int = TARGET_ROUNDS) -> dict:
    """TARGET_PROBE's cases under `other` against the default target, `rounds` alternating
    rounds (target_rounds.alternate: median of the per-round ratios)."""
    return target_rounds.alternate(TARGET_PROBE, [str(Path(__file__).parent), str(threads)], other, rounds)


def plot(wo: list[dict], bw: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({(r["K"], r["N"]) for r in wo})
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes), 3.4), sharey=True, squeeze=False)
    for ax, (k, n) in zip(axes[0], shapes):
        for bits, group, name in ((8, 0, "int8"), (4, 128, "int4 g128")):
            rs = [r for r in wo if (r["K"], r["N"], r["bits"], r["group"]) == (k, n, bits, group)]
            ax.plot([r["M"] for r in rs], [r["weight_GBps"] for r in rs], marker="o", label=f"ours {name}")
            ax.plot([r["M"] for r in rs if r["torch_weight_only_ms"]],
                    [r["weight_GBps"] * r["ours_ms"] / r["torch_weight_only_ms"] for r in rs if r["torch_weight_only_ms"]],
                    ls="--", marker="x", label=f"torch {name}")
        ax.axhline(bw, color="r", lw=1, label="read bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"K={k} N={n}", fontsize=9)
        ax.set_xlabel("M")
    axes[0][0].set_ylabel("GB/s of weight read")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--compare-target", default="2.9",
                    help="also time a few cases under this target (its own pool) vs the default; '' to skip")
    ap.add_argument("--target-rounds", type=int, default=TARGET_ROUNDS,
                    help=f"alternating rounds of the target comparison (default {TARGET_ROUNDS})")
    ap.add_argument("--render", metavar="JSON",
                    help="only rewrite the markdown table and the plot next to JSON from its measurements "
                         "(no timing)")
    args = ap.parse_args()
    if args.target_rounds < 1:
        ap.error(f"--target-rounds must be at least 1, got {args.target_rounds}")
    if args.render:
        src = Path(args.render)
        d = json.loads(src.read_text())
        md = markdown(d["meta"], d["dense"], d["weight_only"], d.get("targets"))
        src.with_suffix(".md").write_text(md)
        plot(d["weight_only"], d["meta"]["read_GBps"], src.with_suffix(".png"))
        print(md)
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # PG_COMMIT names the commit where the tree has no .git (a copy on another machine).
    commit = os.environ.get("PG_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        pass
    commit = commit or "unknown"
    info = pg.info()
    bw = read_bandwidth()
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "torch": torch.__version__, "target": info["target"], "threads": args.threads,
            "isa": info["features"].get("cpu_isa"), "avx2_dq": info["features"].get("cpu_avx2_dq"),
            "cpu_flags": cpu_flags(), "cpu": cpu_model(), "read_GBps": bw,
            "rotation_bytes": LLC_BYTES, "notes_section": NOTES_SECTION}
    print(f"cpu_bench: {json.dumps(meta)}")
    dense = [] if args.skip_dense else bench_dense(args.quick)
    wo = bench_weight_only(args.quick, bw)
    targets = compare_targets(args.compare_target, args.threads, args.target_rounds) if args.compare_target else None
    if targets:
        print(f"  target {targets['target']} / default: " + ", ".join(f"{k} {v:.2f}x" for k, v in targets["ratios"].items()))
    (out / "cpu_bench.json").write_text(json.dumps({"meta": meta, "dense": dense, "weight_only": wo,
                                                    "targets": targets}, indent=1))
    md = markdown(meta, dense, wo, targets)
    (out / "cpu_bench.md").write_text(md)
    plot(wo, bw, out / "cpu_bench.png")
    print()
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

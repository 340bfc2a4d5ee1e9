"""Huge pages on CPU outputs (cpu::advise_new_output; bench/CPU_NOTES.md 64), measured in one
process: `gemm` with the advice (PORTABLE_GEMM_HUGE_PAGES=1) and without (=0), and
torch.matmul, in alternating rounds, with each side's minor page faults per call. Then, with
--weights, the same switch at quantize time: mixed_linear reading weights that lie on huge
pages or on small ones (each set rotated over --rotate-mb).

    python bench/probes/cpu_output_pages.py [--threads 2] [--weights]
    THP_MEM_ALLOC_ENABLE=1 python bench/probes/cpu_output_pages.py   # torch's allocator too

The switch is read on every call, so one process compares both sides.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import time

import torch

import portable_gemm as pg


def timed(fn, reps: int) -> tuple[float, float]:
    """Median seconds of reps calls, and minor faults per call."""
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / reps
    return statistics.median(times), faults


def dense(rounds: int) -> None:
    for dtype, n in ((torch.bfloat16, 4096), (torch.float32, 4096), (torch.bfloat16, 2048),
                     (torch.float32, 2048)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        reps = 5 if n >= 4096 else 15
        sides = {"huge": lambda: pg.gemm(a, b), "small": lambda: pg.gemm(a, b),
                 "torch": lambda: torch.matmul(a, b)}
        for fn in sides.values():
            fn()
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
        for _ in range(rounds):
            for name, fn in sides.items():
                os.environ["PORTABLE_GEMM_HUGE_PAGES"] = "0" if name == "small" else "1"
                got[name].append(timed(fn, reps))
        med = {k: statistics.median(t for t, _ in v) for k, v in got.items()}
        cells = "  ".join(f"{k} " + "/".join(f"{t * 1e3:.2f}" for t, _ in v) + f" ms ({v[-1][1]:.0f} faults)"
                          for k, v in got.items())
        print(f"{str(dtype)[6:]:8} {n}^3  {cells}  huge/small {med['huge'] / med['small']:.3f}  "
              f"torch/huge {med['torch'] / med['huge']:.3f}  torch/small {med['torch'] / med['small']:.3f}",
              flush=True)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose whole 2 MiB pages were advised before the copy first touched them,
    as cpu::advise_new_output does."""
    out = torch.empty_like(t)
    huge = 2 << 20
    begin = (out.data_ptr() + huge - 1) // huge * huge
    end = (out.data_ptr() + out.numel() * out.element_size()) // huge * huge
    if end > begin:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(begin, end - begin, 14) != 0:  # MADV_HUGEPAGE
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE)")
    return out.copy_(t)


def weights(rounds: int, rotate_mb: int) -> None:
    def make(flag: str, k: int, n: int, bits: int, group: int | None):
        os.environ["PORTABLE_GEMM_HUGE_PAGES"] = flag
        w = torch.randn(n, k, dtype=torch.bfloat16)
        count = max(2, rotate_mb * 2**20 // (n * k * bits // 8))
        return [pg.quantize_weight(w + 0.01 * i, bits=bits, group_size=group) for i in range(count)]

    def per_call(sets, x, bits, group) -> float:
        t0 = time.perf_counter()
        for q, s in sets:
            pg.mixed_linear(x, q, s, bits=bits, group_size=group)
        return (time.perf_counter() - t0) / len(sets)

    for k, n, bits, group in ((4096, 4096, 4, 128), (8192, 8192, 4, 128), (4096, 4096, 8, None),
                              (11008, 4096, 8, None)):
        # the bindings do not advise quantize_weight's outputs: copies of them on huge pages
        huge = [(on_huge_pages(q), s) for q, s in make("0", k, n, bits, group)]
        small = make("0", k, n, bits, group)
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            per_call(huge, x, bits, group), per_call(small, x, bits, group)
            th = statistics.median(min(per_call(huge, x, bits, group) for _ in range(3)) for _ in range(rounds))
            ts = statistics.median(min(per_call(small, x, bits, group) for _ in range(3)) for _ in range(rounds))
            gb = n * k * bits / 8 / 1e9
            print(f"int{bits} g{group} K={k} N={n} M={m}: huge {th * 1e6:.1f} us ({gb / th:.1f} GB/s)  "
                  f"small {ts * 1e6:.1f} us ({gb / ts:.1f} GB/s)  huge/small {th / ts:.3f}", flush=True)
        del huge, small


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--weights", action="store_true", help="also the weights' pages (mixed_linear)")
    ap.add_argument("--rotate-mb", type=int, default=480)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')!r}, "
          f"THP mode: {open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}", flush=True)
    dense(args.rounds)
    if args.weights:
        weights(args.rounds, args.rotate_mb)


if __name__ == "__main__":
    main()

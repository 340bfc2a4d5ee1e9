"""Is the per-process slow mode of host-bound calls the host's, and does pinning remove it?

bench/GPU_NOTES.md run 44d: int4 M = 1 eager ran at 14.7-15.0 us or 18.4-23.4 us per call,
fixed for a whole process, under either target; CPU_NOTES 29 saw whole CPU-bench processes
at half speed. This probe needs no portable_gemm: each child process times

  * `host_us`: host time per eager call of a tiny bf16 F.linear (1 x 1024 @ 1024 x 1024 on
    CUDA: the kernel is shorter than its launch, so the host's launch path is the time),
  * `gpu_us`: the same calls' CUDA-event time per call,
  * `py_ns`: a pure Python loop, ns per iteration (the core's own speed),
  * `cpu_mm_us`: a 256^3 fp32 torch.mm on 2 threads (the CPU bench's kind of work),

and reports the CPUs it ran on. The parent alternates free and pinned children (pinned: to
`--cpus`, default the last two CPUs of its own affinity) for `--rounds` rounds and prints
each child's line and, per mode, the spread.

    python bench/probes/host_modes.py --rounds 8 [--cpus 14,15] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, statistics, time, torch
import torch.nn.functional as F

def cpu_now():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])

seen = {cpu_now()}
torch.set_num_threads(2)
out = {"affinity": sorted(os.sched_getaffinity(0))}
t0 = time.perf_counter()
for _ in range(1_000_000):
    pass
out["py_ns"] = (time.perf_counter() - t0) * 1e3
a = torch.randn(256, 256)
for _ in range(20):
    torch.mm(a, a)
ts = []
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(50):
        torch.mm(a, a)
    ts.append((time.perf_counter() - t0) / 50 * 1e6)
out["cpu_mm_us"] = statistics.median(ts)
seen.add(cpu_now())
if torch.cuda.is_available():
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        F.linear(x, w)
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        for _ in range(1000):
            F.linear(x, w)
        host.append((time.perf_counter() - t0) / 1000 * 1e6)
        e1.record()
        torch.cuda.synchronize()
        gpu.append(e0.elapsed_time(e1) / 1000 * 1e3)
    out["host_us"] = statistics.median(host)
    out["gpu_us"] = statistics.median(gpu)
seen.add(cpu_now())
out["ran_on"] = sorted(seen)
print("PROBE" + json.dumps(out))
"""


def child(cpus: list[int] | None) -> dict:
    pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, preexec_fn=pre)
    if proc.returncode != 0:
        raise RuntimeError(f"probe child failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE"))[5:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cpus", default="", help="comma-separated CPUs for the pinned children")
    ap.add_argument("--out", default="", help="folder for host_modes.json")
    args = ap.parse_args()
    mine = sorted(os.sched_getaffinity(0))
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else mine[-2:]
    print(f"parent affinity {mine[0]}..{mine[-1]} ({len(mine)} CPUs); pinned children on {cpus}", flush=True)
    rows = []
    for r in range(args.rounds):
        for mode, pin in (("free", None), ("pinned", cpus)):
            res = child(pin)
            res.update(mode=mode, round=r + 1)
            rows.append(res)
            print(f"round {r + 1:2d} {mode:6s} ran on {res['ran_on']}: host {res.get('host_us', float('nan')):6.2f} us/call, "
                  f"gpu {res.get('gpu_us', float('nan')):6.2f} us/call, python loop {res['py_ns']:5.1f} ns/iter, "
                  f"mm 256^3 {res['cpu_mm_us']:7.1f} us", flush=True)
    for mode in ("free", "pinned"):
        rs = [r for r in rows if r["mode"] == mode]
        for key in ("host_us", "gpu_us", "py_ns", "cpu_mm_us"):
            vals = [r[key] for r in rs if key in r]
            if vals:
                print(f"{mode:6s} {key:9s} min {min(vals):8.2f}  median {statistics.median(vals):8.2f}  "
                      f"max {max(vals):8.2f}  max/min {max(vals) / min(vals):5.2f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_modes.json").write_text(json.dumps({"pinned_cpus": cpus, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

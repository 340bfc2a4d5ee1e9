"""Eager against graph-replayed time of the same calls, with the SM clock and power drawn
during each (run 79f). Runs 77 and 79 timed int4 and int8 at M = 16 on (28672, 8192) 8-12 %
slower replayed than eager; this checks whether the clock is the difference.

Each phase runs for PHASE_S seconds without pause: eager calls (timed with CUDA events per
loop of 50) or replays of a graph of 20 calls. nvidia-smi samples clocks.sm and power.draw
every 50 ms meanwhile; each phase's samples are averaged. Weights rotate past L2 as in the
bench. Usage (repository root): python bench/probes/gpu_replay_clocks.py
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_ab import case_inputs  # noqa: E402
from gpu_bench import capture_graph  # noqa: E402

import portable_gemm as pg  # noqa: E402

PHASE_S = 3.0
CASES = [(28672, 8192, 4, 128, 16), (28672, 8192, 8, 0, 16), (28672, 8192, 4, 128, 1), (8192, 8192, 4, 128, 16)]


def run_phase(step) -> list[float]:
    """Calls step() until PHASE_S has passed; returns its per-call times (us)."""
    times, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < PHASE_S:
        times.append(step())
    return times


def main() -> None:
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    phases = []
    for k, n, bits, g, m in CASES:
        x, _, _, qs, _ = case_inputs(k, n, bits, g, m, torch.bfloat16)
        nq = len(qs)

        def call(i=0):
            qq, ss = qs[i % nq]
            return pg.mixed_linear(x, qq, ss, bits=bits, group_size=g or None)

        def eager():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(50):
                call(i)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3 / 50

        graph = capture_graph(call, 20)

        def replay():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3 / 20

        name = f"({k},{n}) int{bits} g{g or 'ch'} M={m}"
        for label, step in (("eager", eager), ("replay", replay), ("eager again", eager)):
            t0 = time.time()
            times = run_phase(step)
            phases.append((name, label, t0, time.time(), statistics.median(times), min(times)))
        del graph
    time.sleep(0.2)
    smi.terminate()
    samples = []
    for line in smi.stdout.read().splitlines():
        try:
            ts, clk, pw = [v.strip() for v in line.split(",")]
            t = time.mktime(time.strptime(ts.split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + ts.split(".")[1])
            samples.append((t, float(clk), float(pw)))
        except ValueError:
            continue
    print(f"{'case':28s} {'phase':12s} {'median us':>9s} {'best us':>8s} {'SM MHz':>7s} {'W':>6s} samples")
    for name, label, a, b, med, best in phases:
        inside = [(c, p) for t, c, p in samples if a + 0.5 <= t <= b]
        clk = statistics.mean(c for c, _ in inside) if inside else float("nan")
        pw = statistics.mean(p for _, p in inside) if inside else float("nan")
        print(f"{name:28s} {label:12s} {med:9.1f} {best:8.1f} {clk:7.0f} {pw:6.0f} {len(inside)}")


if __name__ == "__main__":
    main()

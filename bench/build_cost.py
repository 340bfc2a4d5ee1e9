"""Builder cost: wall time and wheel size of a wheel with 1 target (2.13) against one with all
5, each built from scratch in its own build folder, same machine, same flags.

    python bench/build_cost.py [--cuda] [--out bench/results]

Goal (DESIGN.md): 5 targets cost <= 1.3x the build time and <= 1.2x the wheel size of 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(targets: str | None, cuda: bool, work: Path) -> tuple[float, int]:
    dist, bdir = work / "dist", work / "build"
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-build-isolation", "--no-deps", "-w", str(dist),
           f"-Cbuild-dir={bdir}", f"-Ccmake.define.PORTABLE_GEMM_CUDA={'ON' if cuda else 'OFF'}"]
    if targets:
        cmd.append(f"-Ccmake.define.PORTABLE_GEMM_TARGETS={targets}")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    elapsed = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in dist.glob("*.whl"))
    return elapsed, size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true", help="include the CUDA kernels and bindings")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = build("2.13", args.cuda, Path(tmp) / "one")
        print(f"1 target : {one[0]:6.1f} s, wheel {one[1] / 1e6:6.2f} MB", flush=True)
        five = build(None, args.cuda, Path(tmp) / "five")
        print(f"5 targets: {five[0]:6.1f} s, wheel {five[1] / 1e6:6.2f} MB", flush=True)
    res = {"cuda": args.cuda, "one_target_s": one[0], "five_targets_s": five[0], "time_ratio": five[0] / one[0],
           "one_target_bytes": one[1], "five_targets_bytes": five[1], "size_ratio": five[1] / one[1]}
    print(f"time ratio {res['time_ratio']:.2f} (goal <= 1.3), size ratio {res['size_ratio']:.2f} (goal <= 1.2)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"build_cost_{'cuda' if args.cuda else 'cpu'}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

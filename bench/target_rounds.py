"""Target comparison shared by the CPU and GPU benchmarks: a probe script timed under another
`PORTABLE_GEMM_TARGET` and under the default one, each in its own interpreter (the loader
picks the target at import), alternating in one run."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys


def alternate(probe: str, argv: list[str], other: str, rounds: int) -> dict:
    """Runs `python -c probe *argv` under the default target and under `other`, alternating
    for `rounds` rounds. The probe prints one line `PROBE{json}`: case -> time (a number, one unit),
    plus text fields such as the target it loaded. The ratio per case is the median over
    rounds of other / default (a noisy neighbour then hits both sides of a round alike). The
    side that runs first swaps every round, so that a state the first process leaves behind
    (a warmer GPU, a page cache) does not always favour or burden the same side."""
    raw: dict[str, list] = {"default": [], "other": []}
    sides = (("default", None), ("other", other))
    for r in range(rounds):
        for label, env_target in (sides if r % 2 == 0 else sides[::-1]):
            env = dict(os.environ)
            env.pop("PORTABLE_GEMM_TARGET", None)
            if env_target:
                env["PORTABLE_GEMM_TARGET"] = env_target
            proc = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"target probe ({label}, {env_target or 'default'}) failed with "
                                   f"exit {proc.returncode}:\n{proc.stderr[-2000:]}")
            raw[label].append(json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE"))[5:]))
        print(f"  target comparison round {r + 1}/{rounds} done", flush=True)
    keys = [k for k, v in raw["default"][0].items() if isinstance(v, (int, float))]
    ratios = {k: statistics.median(o[k] / d[k] for o, d in zip(raw["other"], raw["default"])) for k in keys}
    return {"target": raw["other"][0]["target"], "default_target": raw["default"][0]["target"],
            "ratios": ratios, "raw": raw}


def fastest(result: dict) -> dict:
    """Per case, each side's fastest round against the other's: other / default. A process can
    run slow as a whole (seen on both sides, CPU and GPU hosts), which a median of per-round
    ratios does not cancel; the fastest rounds show what the code itself costs."""
    raw = result["raw"]
    return {k: min(o[k] for o in raw["other"]) / min(d[k] for d in raw["default"]) for k in result["ratios"]}

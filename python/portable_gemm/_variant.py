"""Choosing which compiled target to load: a pure function over versions, no binaries.

Each target T was compiled with TORCH_TARGET_VERSION=T against the stable ABI, so it runs on
any torch whose major.minor >= T (the stable ABI only grows). The newest such target wins;
every other candidate gets a one-line reason the user can read in `info()` or an ImportError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

Version = tuple[int, int]


def parse_version(text: str) -> Version:
    """'2.13.0+cpu', '2.14.0a0+gitabc', '2.10.0.dev20250101', '2.9' -> (major, minor)."""
    m = re.match(r"^\s*(\d+)\.(\d+)", text)
    if not m:
        raise ValueError(f"cannot read a major.minor version from {text!r}")
    return int(m.group(1)), int(m.group(2))


def parse_target(text: str) -> Version:
    """A built target or a PORTABLE_GEMM_TARGET value: the whole text is major.minor
    ('2.10', surrounding whitespace allowed); '2.13abc' or '2.10.5' is refused."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a target version like '2.10' (major.minor)")
    return int(m.group(1)), int(m.group(2))


def format_version(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


@dataclass(frozen=True)
class Candidate:
    target: str
    status: str  # "selected" | "eligible" | "rejected"
    reason: str


@dataclass(frozen=True)
class Selection:
    torch_version: str
    target: str | None
    candidates: list[Candidate] = field(default_factory=list)
    error: str | None = None

    def explain(self) -> str:
        """One line per candidate; one line in all when every candidate has the same status
        and reason (a torch older than the oldest target rejects them all alike)."""
        cands = self.candidates
        if len(cands) > 1 and len({(c.status, c.reason) for c in cands}) == 1:
            return f"  {', '.join(c.target for c in cands)}: {cands[0].status} - {cands[0].reason}"
        lines = [f"  {c.target}: {c.status} - {c.reason}" for c in cands]
        return "\n".join(lines) if lines else "  (no targets built)"


def select_variant(
    torch_version: str,
    built_targets: list[str],
    forced: str | None = None,
    minimum: str = "2.9",
) -> Selection:
    """Pick the newest built target <= the runtime's major.minor (or the forced one).

    Returns a Selection whose `error` is set (and `target` None) when nothing can be loaded;
    the loader turns that into an ImportError carrying `explain()`. A version that cannot be
    read in torch_version, built_targets or minimum raises ValueError.
    """
    runtime = parse_version(torch_version)
    rt = format_version(runtime)
    targets = sorted({parse_target(t) for t in built_targets}, reverse=True)
    if runtime < parse_version(minimum):
        reason = f"torch {torch_version} is older than {minimum}, the oldest stable ABI this wheel targets"
        cands = [Candidate(format_version(t), "rejected", reason) for t in targets]
        return Selection(torch_version, None, cands,
                         f"requires torch >= {minimum}; found torch {torch_version}: upgrade torch "
                         f"(pip install 'torch>={minimum}')")

    forced_v = None
    if forced is not None and forced.strip():
        try:
            forced_v = parse_target(forced)
        except ValueError:
            return Selection(torch_version, None,
                             [Candidate(format_version(t), "rejected", "not considered: PORTABLE_GEMM_TARGET is malformed") for t in targets],
                             f"PORTABLE_GEMM_TARGET={forced!r} is not a version like '2.10'")

    chosen = None
    cands: list[Candidate] = []
    for t in targets:
        ts = format_version(t)
        if t > runtime:
            cands.append(Candidate(ts, "rejected",
                                   f"needs torch >= {ts} (uses stable-ABI symbols added in {ts}); runtime is {rt}"))
        elif forced_v is not None and t != forced_v:
            cands.append(Candidate(ts, "eligible", f"runs on {rt}, but PORTABLE_GEMM_TARGET={forced} was forced"))
        elif chosen is None:
            chosen = ts
            why = "forced by PORTABLE_GEMM_TARGET" if forced_v is not None else f"newest target <= torch {rt}"
            cands.append(Candidate(ts, "selected", why))
        else:
            cands.append(Candidate(ts, "eligible", f"runs on {rt}, but {chosen} is newer"))

    if chosen is not None:
        return Selection(torch_version, chosen, cands)
    if forced_v is not None:
        fs = format_version(forced_v)
        if forced_v not in targets:
            err = f"PORTABLE_GEMM_TARGET={forced} names no built target (built: {', '.join(format_version(t) for t in targets)})"
        else:
            runnable = [format_version(t) for t in targets if t <= runtime]
            err = (f"PORTABLE_GEMM_TARGET={forced} is newer than the installed torch {torch_version}: target {fs} "
                   f"needs torch >= {fs}; unset PORTABLE_GEMM_TARGET"
                   + (f" or choose one of {', '.join(runnable)}" if runnable else ""))
        return Selection(torch_version, None, cands, err)
    return Selection(torch_version, None, cands, f"no built target runs on torch {torch_version}")

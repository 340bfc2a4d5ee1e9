"""info(): what was loaded and why, as a plain dict (also `python -m portable_gemm info`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from ._env import sm90_disabled


def info() -> dict:
    """Torch version, the target loaded, every built target with the reason it was taken
    or rejected, the features in force, CUDA status, library paths and the build manifest."""
    from . import _state

    features = dict(_state.features)
    if _state.cpu_binding is not None:  # what runs the CPU ops now (changes in a forked child)
        now = _state.cpu_binding.current_info()
        features.update({k: now[k] for k in ("threading", "threading_why") if k in now})
    features["cpu_huge_pages"] = huge_pages_state(os.environ.get("PORTABLE_GEMM_HUGE_PAGES"), _thp_mode())
    if _state.cpu_binding is not None and _state.cpu_binding.info.get("fill_outputs"):  # the kernel library's own reading
        features["fill_outputs"] = ("on: fresh outputs are 0xFF (NaN) before the kernels run "
                                    "(PORTABLE_GEMM_FILL_OUTPUTS=1, a debugging aid)")
    from ._scratch import cpu_scratch_bytes

    features["cpu_scratch"] = (f"{cpu_scratch_bytes() / 2**20:.1f} MiB held between calls "
                               "(release_cpu_scratch() frees it)")
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "namespace": _state.namespace,
        "target": _state.target,
        "candidates": [{"target": c.target, "status": c.status, "reason": c.reason}
                       for c in _state.candidates],
        "features": features,
        "cuda": {"loaded": _state.cuda_loaded, "reason": _state.cuda_reason},
        "libraries": dict(_state.libraries),
        "manifest": _state.manifest,
    }


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), None off Linux
    or where the kernel has no THP."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def huge_pages_state(env: str | None, thp_mode: str | None) -> str:
    """What CPU outputs of 32 MiB and more get before the kernel's first touch
    (cpu::advise_new_output, read on every call; bench/CPU_NOTES.md 64, 65), in one line."""
    if thp_mode is None:
        return "small pages: no transparent huge pages on this system"
    if env == "0":
        return f"off (PORTABLE_GEMM_HUGE_PAGES=0; THP mode {thp_mode})"
    if thp_mode == "never":
        return "advised, but the THP mode is never: small pages"
    if thp_mode == "always":
        return "huge pages (THP mode always; the advice is redundant)"
    return f"huge pages: outputs of 32 MiB and more advised (THP mode {thp_mode})"


def format_info(d: dict) -> str:
    lines = [f"portable_gemm {d['manifest'].get('project_version', '?')} "
             f"(torch.ops.{d['namespace']}" + ("; a vendored copy)" if d["manifest"].get("vendored") else ")"),
             f"torch        {d['torch']}" + (f" (CUDA {d['torch_cuda']})" if d['torch_cuda'] else " (CPU-only build)"),
             f"target       {d['target']}",
             "candidates:"]
    for c in d["candidates"]:
        lines.append(f"  {c['target']:<6} {c['status']:<9} {c['reason']}")
    lines.append("features:")
    for k, v in d["features"].items():
        lines.append(f"  {k:<17} {v}")
    cuda = d["cuda"]
    lines.append(f"cuda         {'loaded' if cuda['loaded'] else 'not loaded'}: {cuda['reason']}")
    lines.append("libraries:")
    for k, v in d["libraries"].items():
        lines.append(f"  {k:<8} {v}")
    m = d["manifest"]
    tc = m.get("toolchain", {})
    lines.append(f"build        torch {m.get('build_torch')} headers, {tc.get('cxx')}"
                 + (f", {tc['cuda']['compiler']} ({tc['cuda']['archs']})" if tc.get("cuda") else ", no CUDA"))
    if tc.get("cuda"):
        off = os.environ.get("PORTABLE_GEMM_DISABLE_SM90") if sm90_disabled(os.environ) else None
        lines.append("sm_90 gemm   " + (tc["cuda"].get("sm90_gemm") or "portable kernel (built without CUTLASS)")
                     + (f" (off: PORTABLE_GEMM_DISABLE_SM90={off})" if off is not None else ""))
    lines.append(f"source       {source_commit(m) or 'not built from a git checkout'}")
    return "\n".join(lines)


def source_commit(manifest: dict) -> str | None:
    """The git commit the binaries were built from, '-dirty' appended when tracked files
    differed from it at configure time; None when not built from a git checkout."""
    src = manifest.get("source")
    if not src:
        return None
    return src["commit"] + ("-dirty" if src.get("dirty") else "")

"""info(): what was loaded and why, as a plain dict (also `python -m portable_gemm info`)."""

from __future__ import annotations

import torch


def info() -> dict:
    """Torch version, the target loaded, every built target with the reason it was taken
    or rejected, the features in force, CUDA status, library paths and the build manifest."""
    from . import _state

    features = dict(_state.features)
    if _state.cpu_binding is not None:  # what runs the CPU ops now (changes in a forked child)
        now = _state.cpu_binding.current_info()
        features.update({k: now[k] for k in ("threading", "threading_why") if k in now})
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


def format_info(d: dict) -> str:
    lines = [f"portable_gemm {d['manifest'].get('project_version', '?')} "
             f"(torch.ops.{d['namespace']})",
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
        lines.append("sm_90 gemm   " + (tc["cuda"].get("sm90_gemm") or "portable kernel (built without CUTLASS)"))
    lines.append(f"source       {source_commit(m) or 'not built from a git checkout'}")
    return "\n".join(lines)


def source_commit(manifest: dict) -> str | None:
    """The git commit the binaries were built from, '-dirty' appended when tracked files
    differed from it at configure time; None when not built from a git checkout."""
    src = manifest.get("source")
    if not src:
        return None
    return src["commit"] + ("-dirty" if src.get("dirty") else "")

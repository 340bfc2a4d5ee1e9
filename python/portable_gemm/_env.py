"""The PORTABLE_GEMM_* settings the kernels and bindings read, checked once when they load.

A value they would ignore, or one that does nothing under the loaded target, gets a one-line
RuntimeWarning naming what happens instead, pointing at the user's import (not at this
package). Pure functions over an environment mapping; torch-free (the DLPack door uses them).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping

from ._namespace import WHO

# PORTABLE_GEMM_ISA's names (the kernel library's cpu::isa_request; "amx" lowers nothing).
CPU_ISA_NAMES = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
# The executor name a binding reports when its CPU ops run on torch's own pool.
TORCH_POOL = "torch::stable::parallel_for"


def pool_threads(value: str | None) -> int | None:
    """PORTABLE_GEMM_NUM_THREADS as the kernel library reads it (kernels.h, env_pool_threads):
    a whole number >= 1, else None (unset, empty or malformed: ignored)."""
    if value is None or not re.fullmatch(r"[ \t\n\v\f\r]*\+?[0-9]+", value):
        return None
    n = int(value)
    return n if n >= 1 else None


def sm90_disabled(environ: Mapping[str, str]) -> bool:
    """Whether PORTABLE_GEMM_DISABLE_SM90 turns the sm_90 kernels off, read as the CUDA
    kernels read it (sm90_dispatch.cu): any value that is not empty and not starting with 0."""
    value = environ.get("PORTABLE_GEMM_DISABLE_SM90", "")
    return value != "" and not value.startswith("0")


def problems(environ: Mapping[str, str], *, cpu_isa: str, target: str | None = None,
             threading: str | None = None, threading_why: str | None = None) -> list[str]:
    """One line per setting that is ignored or has no effect. target: the torch binding's
    loaded target (threading: what runs its CPU ops, and why); None for the DLPack door,
    which has no torch ops and always runs on the library's own pool."""
    out = []
    isa = environ.get("PORTABLE_GEMM_ISA", "")
    if isa not in ("",) + CPU_ISA_NAMES:
        out.append(f"PORTABLE_GEMM_ISA={isa!r} is not one of {', '.join(CPU_ISA_NAMES)}; ignored, the CPU "
                   f"kernels run on {cpu_isa}")
    threads = environ.get("PORTABLE_GEMM_NUM_THREADS")
    if threads not in (None, "") and pool_threads(threads) is None:
        out.append(f"PORTABLE_GEMM_NUM_THREADS={threads!r} is not a whole number >= 1; ignored")
    huge = environ.get("PORTABLE_GEMM_HUGE_PAGES")
    if huge not in (None, "", "0", "1"):
        out.append(f"PORTABLE_GEMM_HUGE_PAGES={huge!r} is neither '0' (off) nor '1' (on); outputs of 32 MiB "
                   "and more are still offered huge pages")
    dq = environ.get("PORTABLE_GEMM_AVX2_DQ")
    if dq not in (None, "", "0", "1"):
        out.append(f"PORTABLE_GEMM_AVX2_DQ={dq!r} is neither '0' (never) nor '1' (on every AVX2 core); the CPU's "
                   "core decides where AVX2's dequantise-once path runs")
    elif dq and cpu_isa != "avx2":
        out.append(f"PORTABLE_GEMM_AVX2_DQ={dq!r} applies to the AVX2 kernels only; the CPU kernels run on "
                   f"{cpu_isa} (PORTABLE_GEMM_ISA=avx2 selects them)")
    sm90 = environ.get("PORTABLE_GEMM_DISABLE_SM90")
    if sm90 not in (None, "", "0", "1"):
        out.append(f"PORTABLE_GEMM_DISABLE_SM90={sm90!r} is neither '0' nor '1'; the CUDA kernels read it as "
                   + ("'1': the sm_90 kernels are off" if sm90_disabled(environ) else "'0': the sm_90 kernels are on"))
    fill = environ.get("PORTABLE_GEMM_FILL_OUTPUTS")
    if fill not in (None, "", "0", "1"):
        out.append(f"PORTABLE_GEMM_FILL_OUTPUTS={fill!r} is neither '0' nor '1'; outputs are not filled")
    if target is None:
        return out
    pool = environ.get("PORTABLE_GEMM_POOL", "")
    # what the binding says runs its CPU ops (compat/threading.h decides per target): on
    # torch's pool neither POOL nor NUM_THREADS is read
    on_torch_pool = threading == TORCH_POOL
    if pool not in ("", "own", "openmp"):
        out.append(f"PORTABLE_GEMM_POOL={pool!r} is neither 'own' nor 'openmp'; target {target}'s CPU ops "
                   f"run on {threading} ({threading_why})")
    elif pool and on_torch_pool:
        out.append(f"PORTABLE_GEMM_POOL={pool!r} applies to target 2.9 only; target {target}'s CPU ops run on "
                   f"{threading} ({threading_why})")
    if on_torch_pool and pool_threads(threads) is not None:
        out.append(f"PORTABLE_GEMM_NUM_THREADS={threads!r} sizes the library's own pool, which target {target}'s "
                   "torch ops do not use (torch.set_num_threads sizes theirs); only the DLPack door reads it")
    return out


def _ours(filename: str) -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    return (filename.startswith(here + os.sep) or filename.startswith("<frozen importlib")
            or os.path.basename(os.path.dirname(filename)) == "importlib")


def _bootstrap(filename: str) -> bool:
    return "importlib" in filename and "_bootstrap" in filename


def warn_all(messages: list[str]) -> None:
    """Each message as a RuntimeWarning attributed to the first frame outside this package
    and the import machinery (the user's `import portable_gemm` or first call)."""
    if not messages:
        return
    # stacklevel counts frames from this one, leaving out those of importlib's bootstrap
    # (warnings skips them itself, as CPython's _is_internal_frame says).
    frame, level = sys._getframe(0), 1
    while frame is not None and _ours(frame.f_code.co_filename):
        frame = frame.f_back
        if frame is not None and not _bootstrap(frame.f_code.co_filename):
            level += 1
    for m in messages:
        warnings.warn(f"{WHO}: {m}", RuntimeWarning, stacklevel=level)

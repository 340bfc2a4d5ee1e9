"""The CPU kernels' scratch: the buffers each thread keeps between calls, and their release."""

from __future__ import annotations

import ctypes

_fns = None


def _kernel_fns():
    """The kernel library's two scratch entry points (extern "C"), bound once."""
    global _fns
    if _fns is None:
        from . import _load

        lib = ctypes.CDLL(_load().libraries["kernels"])
        held, release = lib.portable_gemm_cpu_scratch_bytes, lib.portable_gemm_release_cpu_scratch
        for fn in (held, release):
            fn.argtypes = []
            fn.restype = ctypes.c_size_t
        _fns = held, release
    return _fns


def cpu_scratch_bytes() -> int:
    """Bytes the CPU kernels' scratch buffers hold now, all threads together."""
    return int(_kernel_fns()[0]())


def release_cpu_scratch() -> int:
    """Free the CPU kernels' scratch buffers and return the number of bytes freed.

    Every thread that has run a CPU op keeps its packed panels, partial sums and converted
    inputs for the next call, grown to the largest call it has seen (tens of MiB a thread after
    a 4096 x 4096 GEMM; a fresh buffer would cost its page faults on every call). This frees the
    buffers of every thread not inside a portable_gemm CPU call at that moment; it never waits,
    and a thread inside a call keeps its own. With glibc the heap's free pages then go back to
    the system (``malloc_trim``), so the process's resident memory drops. The next call on each
    thread allocates what it needs again. CUDA ops keep no scratch of their own: their
    temporaries come from torch's caching allocator (``torch.cuda.empty_cache()``).

    Example::

        y = portable_gemm.gemm(a, b)                # a large CPU GEMM
        freed = portable_gemm.release_cpu_scratch()  # e.g. before a memory-hungry phase
    """
    return int(_kernel_fns()[1]())

"""Large CPU outputs are offered transparent huge pages before the kernel's first touch
(cpu::advise_new_output; bench/CPU_NOTES.md 64): the advice reaches the output's whole
2 MiB pages and nothing else, PORTABLE_GEMM_HUGE_PAGES=0 turns it off, the results do
not change, and info() says what outputs get. The mapping checks are Linux only: the advice
is madvise(MADV_HUGEPAGE), seen as the "hg" flag of the mapping in /proc/self/smaps,
whatever the system's THP mode."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_close, dequant_ref, run_python

import portable_gemm as pg
import portable_gemm.dlpack as door

THP = Path("/sys/kernel/mm/transparent_hugepage")
HUGE = int((THP / "hpage_pmd_size").read_text()) if (THP / "hpage_pmd_size").exists() else 2 << 20

linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or HUGE != 2 << 20,
    reason="needs Linux with transparent huge pages of 2 MiB (the shapes below are sized for them)")


def vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping that holds addr."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def huge_pages_inside(ptr: int, nbytes: int) -> list[int]:
    first = (ptr + HUGE - 1) // HUGE * HUGE
    return list(range(first, (ptr + nbytes) // HUGE * HUGE, HUGE))


# more than glibc's largest mmap threshold and kHugeOutputMinBytes (32 MiB): each output is
# a mapping of its own, so a page not advised cannot carry an earlier call's flag
M, K, N = 4104, 24, 4096


@linux_thp
def test_gemm_output_advised_and_switch_off(monkeypatch):
    a, b = torch.randn(M, K, dtype=torch.bfloat16), torch.randn(K, N, dtype=torch.bfloat16)
    monkeypatch.setenv("PORTABLE_GEMM_HUGE_PAGES", "1")
    out = pg.gemm(a, b)
    ptr, nbytes = out.data_ptr(), out.numel() * out.element_size()
    pages = huge_pages_inside(ptr, nbytes)
    assert len(pages) >= 15
    assert all("hg" in vm_flags(p) for p in pages)
    # the partial huge pages at either end are not wholly ours: not advised
    if pages[0] > ptr:
        assert "hg" not in vm_flags(pages[0] - 4096)
    if pages[-1] + HUGE < ptr + nbytes:
        assert "hg" not in vm_flags(pages[-1] + HUGE)
    assert_close(out, a.double() @ b.double(), torch.bfloat16)

    monkeypatch.setenv("PORTABLE_GEMM_HUGE_PAGES", "0")
    off = pg.gemm(a, b)
    off_pages = huge_pages_inside(off.data_ptr(), off.numel() * off.element_size())
    assert off_pages and not any("hg" in vm_flags(p) for p in off_pages)
    assert torch.equal(out, off)


@linux_thp
def test_mixed_linear_output_advised():
    w = torch.randn(N, 256, dtype=torch.bfloat16)
    q, s = pg.quantize_weight(w, bits=8)
    x = torch.randn(M, 256, dtype=torch.bfloat16)
    out = pg.mixed_linear(x, q, s, bits=8)
    pages = huge_pages_inside(out.data_ptr(), out.numel() * out.element_size())
    assert pages and all("hg" in vm_flags(p) for p in pages)
    assert_close(out, x.double() @ dequant_ref(q, s, 8, None).double().T, torch.bfloat16)
    # the weights are not advised (notes 64: no faster on huge pages)
    assert not any("hg" in vm_flags(p) for p in huge_pages_inside(q.data_ptr(), q.numel()))


@linux_thp
def test_heap_outputs_not_advised():
    # Below kHugeOutputMinBytes (32 MiB, glibc's largest mmap threshold), in a fresh process
    # (an earlier test's outputs would not matter, but its heap would):
    # - a 16 MiB output, twice: the first is a mapping of its own, and freeing it raises
    #   glibc's threshold, so the second comes from the heap. Neither is advised, and an
    #   8 MiB tensor of the caller's own, allocated next on that heap memory, carries no
    #   advice (with a 4 MiB threshold it did: bench/CPU_NOTES.md 65);
    # - an output of 32 MiB less 64 B is not advised, one of 32 MiB + 4 KiB is.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import torch, portable_gemm as pg\n"
            "from test_huge_pages import vm_flags, huge_pages_inside\n"
            "a, b = torch.randn(8, 8), torch.randn(8, (1 << 20) + 1024)\n"
            "def hg(t):\n"
            "    pages = huge_pages_inside(t.data_ptr(), t.numel() * t.element_size())\n"
            "    return len(pages), sum('hg' in vm_flags(p) for p in pages)\n"
            "for i in range(2):\n"
            "    out = pg.gemm(a, b[:, :1 << 19])\n"
            "    where = out.data_ptr()\n"
            "    print('out16', out.numel() * 4, *hg(out))\n"
            "    del out\n"
            "mine = torch.empty(2, 1 << 20)\n"
            "print('mine', int(where <= mine.data_ptr() < where + (16 << 20)), *hg(mine))\n"
            "for n in ((1 << 20) - 2, (1 << 20) + 128):\n"
            "    out = pg.gemm(a, b[:, :n])\n"
            "    print('out', out.numel() * 4, *hg(out))\n")
    proc = run_python(code, unset=("PORTABLE_GEMM_HUGE_PAGES",))
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[0] for line in lines] == ["out16", "out16", "mine", "out", "out"], proc.stdout
    for name, size, pages, advised in (lines[0], lines[1], lines[3]):
        assert int(size) < 32 << 20 and int(pages) >= 6 and int(advised) == 0, \
            f"{advised} of {pages} whole huge pages of a {size}-byte output advised"
    _, on_heap, pages, advised = lines[2]
    assert int(pages) >= 3 and advised == "0", \
        f"{advised} of {pages} whole huge pages of the caller's own tensor advised"
    # glibc hands the freed output's memory to the next allocation that fits; ASan's
    # allocator (ci/sanitize.sh preloads it) quarantines freed memory instead, so there the
    # tensor lands elsewhere and only the check above stands
    assert on_heap == "1" or "libasan" in os.environ.get("LD_PRELOAD", ""), \
        "the 8 MiB tensor did not reuse the freed output's memory: " + proc.stdout
    _, size, pages, advised = lines[4]
    assert int(size) == (32 << 20) + 4096 and int(pages) >= 15 and advised == pages, \
        f"{advised} of {pages} whole huge pages of a {size}-byte output advised"


@linux_thp
def test_dlpack_fresh_output_advised():
    a = np.random.default_rng(0).standard_normal((M, K), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((K, N), dtype=np.float32)
    out = door.gemm(a, b)
    pages = huge_pages_inside(out.__array_interface__["data"][0], out.nbytes)
    assert pages and all("hg" in vm_flags(p) for p in pages)
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)


@linux_thp
def test_info_reports_the_advice(monkeypatch):
    from portable_gemm._info import _thp_mode

    mode = _thp_mode()
    assert mode in ("always", "madvise", "never")
    monkeypatch.setenv("PORTABLE_GEMM_HUGE_PAGES", "0")
    assert pg.info()["features"]["cpu_huge_pages"] == f"off (PORTABLE_GEMM_HUGE_PAGES=0; THP mode {mode})"
    monkeypatch.delenv("PORTABLE_GEMM_HUGE_PAGES")
    assert "off" not in pg.info()["features"]["cpu_huge_pages"]


@pytest.mark.parametrize("env, mode, want", [
    (None, "madvise", "huge pages: outputs of 32 MiB and more advised (THP mode madvise)"),
    ("1", "madvise", "huge pages: outputs of 32 MiB and more advised (THP mode madvise)"),
    ("0", "madvise", "off (PORTABLE_GEMM_HUGE_PAGES=0; THP mode madvise)"),
    (None, "always", "huge pages (THP mode always; the advice is redundant)"),
    (None, "never", "advised, but the THP mode is never: small pages"),
    ("0", None, "small pages: no transparent huge pages on this system"),
])
def test_huge_pages_state(env, mode, want):
    from portable_gemm._info import huge_pages_state

    assert huge_pages_state(env, mode) == want

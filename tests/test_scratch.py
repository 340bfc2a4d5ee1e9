"""release_cpu_scratch / cpu_scratch_bytes: the CPU kernels' per-thread buffers, measured and
released through the torch package, the DLPack door and info(); releases while other threads
call never disturb a result; the process's resident memory drops by what a release frees.
(tests/cpp/test_kernels_cpu.cpp checks the same on the kernel library's own pool, with mutants
of the busy marking caught there.)"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import REPO, assert_close, gemm_ref, rand, run_python

import portable_gemm as pg
import portable_gemm.dlpack as door


def test_release_frees_what_calls_left_and_calls_still_right():
    a, b = rand((512, 384), torch.float32), rand((384, 640), torch.float32)
    x = rand((64, 1024), torch.bfloat16)
    q, s = pg.quantize_weight(rand((768, 1024), torch.bfloat16), bits=4, group_size=128)
    pg.gemm(a, b)
    pg.mixed_linear(x, q, s, bits=4, group_size=128)
    held = pg.cpu_scratch_bytes()
    assert held >= 384 * 64 * 4, held  # at least one packed panel of b
    assert pg.release_cpu_scratch() == held
    assert pg.cpu_scratch_bytes() == 0
    assert pg.release_cpu_scratch() == 0
    assert_close(pg.gemm(a, b), gemm_ref(a, b), torch.float32)
    assert pg.cpu_scratch_bytes() > 0


def test_info_reports_the_scratch_held():
    pg.gemm(rand((256, 256), torch.float32), rand((256, 256), torch.float32))
    line = pg.info()["features"]["cpu_scratch"]
    assert line.endswith("MiB held between calls (release_cpu_scratch() frees it)"), line
    assert float(line.split()[0]) == pytest.approx(pg.cpu_scratch_bytes() / 2**20, abs=0.051)
    pg.release_cpu_scratch()
    assert pg.info()["features"]["cpu_scratch"].startswith("0.0 MiB"), pg.info()["features"]["cpu_scratch"]


def test_dlpack_door_shares_the_release():
    a = np.random.default_rng(3).standard_normal((300, 200), dtype=np.float32)
    door.gemm(a, a.T.copy())
    assert door.cpu_scratch_bytes() == pg.cpu_scratch_bytes() > 0  # one kernel library
    freed = door.release_cpu_scratch()
    assert freed > 0 and door.cpu_scratch_bytes() == 0 and pg.cpu_scratch_bytes() == 0


def test_release_while_threads_call():
    # Two threads call for 0.5 s on torch's threads (or the own pool) while this one releases
    # every ~0.2 ms: every result must equal the one computed before, and some releases must
    # have freed memory in between (else nothing was tested).
    torch.manual_seed(11)
    a, b = torch.randn(256, 512), torch.randn(512, 256)
    x = torch.randn(8, 2048, dtype=torch.bfloat16)
    q, s = pg.quantize_weight(torch.randn(1024, 2048, dtype=torch.bfloat16), bits=8)
    calls = [lambda: pg.gemm(a, b), lambda: pg.mixed_linear(x, q, s, bits=8)]
    refs = [c() for c in calls]
    stop, bad, done = threading.Event(), [], [0, 0]

    def worker(i):
        while not stop.is_set():
            out = calls[i]()
            if not torch.equal(out, refs[i]):
                bad.append(i)
            done[i] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    released, end = 0, time.monotonic() + 0.5
    while time.monotonic() < end:
        released += pg.release_cpu_scratch() > 0
        time.sleep(0.0002)
    stop.set()
    for t in threads:
        t.join()
    assert not bad, f"{len(bad)} of {sum(done)} results differed"
    assert min(done) > 0 and released > 0, (done, released)
    pg.release_cpu_scratch()
    assert pg.cpu_scratch_bytes() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan's allocator quarantines freed memory and has no malloc_trim")
def test_resident_memory_drops_by_what_a_release_frees():
    # In a fresh process: a 2048^2 fp32 GEMM and a bf16 one on 4 threads leave MiBs of
    # scratch (tens with the AVX-512 kernels' panels; ~9 with AVX2's and ~3 with the generic
    # ones on an AVX2 Zen 3, where 2 threads held 4.3 and 1.6); the release frees all of it,
    # and then the resident set is smaller by at least half of what it freed, and a
    # further malloc_trim finds little left to hand back: the release trimmed the heap itself
    # (glibc keeps freed blocks below its mmap threshold otherwise; without the trim a further
    # one handed back ~19 of 26 MiB here).
    proc = run_python("""
import ctypes, os, torch, portable_gemm as pg
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
torch.set_num_threads(4)  # each worker keeps its own buffers: more of them to measure
for dt in (torch.float32, torch.bfloat16):
    a = torch.randn(2048, 2048).to(dt)
    y = pg.gemm(a, a)
    del y
held = pg.cpu_scratch_bytes()
before = rss()
freed = pg.release_cpu_scratch()
after = rss()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc itself, whatever is preloaded
print(held, freed, before - after, after - rss(), pg.info()["features"]["cpu_isa"])
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    held, freed, dropped, trimmed_later = map(int, proc.stdout.split()[-5:-1])
    assert freed == held >= 1 << 20, (held, freed, proc.stdout.split()[-1])
    assert dropped >= freed // 2, f"freed {freed} bytes, resident set dropped by {dropped}"
    assert trimmed_later <= freed // 8, f"a malloc_trim after the release handed back {trimmed_later} more bytes"


def test_kernels_run_tasks_only_through_run_tasks():
    # A task started with exec.parallel_for directly would run without its ScratchUse: its
    # thread's buffers would be pinned for good (or, had scratch() no such guard, freed under
    # it). run_tasks (gemm.cpp) is the one caller; the pool's own file implements it.
    direct = []
    for path in sorted((REPO / "src/kernels/cpu").glob("*.cpp")):
        if path.name == "thread_pool.cpp":
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if ".parallel_for(" in line:
                direct.append(f"{path.name}:{no}: {line.strip()}")
    assert len(direct) == 1 and direct[0].startswith("gemm.cpp:"), direct
    assert direct[0].endswith("exec.parallel_for(exec.self, begin, end, grain, run_task, &call);"), direct


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("pool", ["", "own"])
def test_release_in_a_forked_child(pool):
    # Only the forking thread lives on in a child; the parent's workers' thread-local blocks
    # are freed by glibc once the child's new threads reuse their stacks, so the registry
    # must not list them there (ASan caught it reading one). Target 2.9, whose CPU threads
    # survive fork() (torch's OpenMP runtime, or the library's own pool); torch's own ops
    # are left out of the child (GNU OpenMP may hang there).
    proc = run_python("""
import os, torch, portable_gemm as pg
torch.set_num_threads(2)
a = torch.randn(512, 512)
ref = pg.gemm(a, a).numpy().tobytes()
pid = os.fork()
if pid == 0:
    ok = True
    for _ in range(2):
        ok = ok and pg.gemm(a, a).numpy().tobytes() == ref and pg.cpu_scratch_bytes() > 0
        ok = ok and pg.release_cpu_scratch() > 0 and pg.cpu_scratch_bytes() == 0
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
""", env={"PORTABLE_GEMM_TARGET": "2.9", "PORTABLE_GEMM_POOL": pool}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["exit", "0"], proc.stdout[-500:]

"""Shared test helpers: named shape lists, float64 references, per-dtype tolerances, and
sentinel-filled outputs.

Sentinel: every output the ops allocate starts as NaN (0xFF bytes; -1 in int8). torch's own
fill (use_deterministic_algorithms(True), below, for the tensors the tests make) does not
reach the outputs the torch binding allocates through the AOTI shim's empty_strided on the
CPU, so the tests set PORTABLE_GEMM_FILL_OUTPUTS=1 (before anything loads the kernel
library, which reads it once; child processes inherit it): the doors fill their fresh
outputs before the kernel runs. An element a kernel forgot to write stays NaN and fails the
comparison (assert_close refuses any NaN). `test_sentinel_is_active` checks it is on.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

os.environ["PORTABLE_GEMM_FILL_OUTPUTS"] = "1"  # before torch's import, which may load portable_gemm
# torch.compile's caches (FX graph, AOTAutograd) live under /tmp across runs, and their keys
# leave out a custom op's Python kernels (fake, autograd, autocast): an entry compiled against
# an older build of the package is reused for this one (an autocast rule added since then
# went unseen, its graph served from the cache). One fresh cache per test session, inherited
# by the child processes (AOTInductor packages); removed at exit. A cache chosen by the caller stays.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _compile_cache = tempfile.mkdtemp(prefix="portable_gemm-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _compile_cache
    atexit.register(shutil.rmtree, _compile_cache, ignore_errors=True)
import torch  # noqa: E402

from _tree import REPO  # noqa: E402  (the one definition of the repository root)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative Frobenius error allowed against a float64 reference. Output rounding dominates:
# a correct kernel measures ~1.6e-3 in bf16 and ~2e-4 in fp16 (half an ulp, 2^-9 / 2^-12,
# over random signs); the limits are ~4-5x that, so that accumulating in the 16-bit type
# (K = 70 gives ~1e-2 in bf16, ~1.2e-3 in fp16) or dropping a k step fails.
TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 6e-3}
ACTIVATIONS = ["none", "relu", "silu", "gelu"]

# (M, K, N)
ALIGNED = [(64, 64, 64), (128, 256, 512), (256, 512, 128)]
ODD = [(1, 1, 1), (7, 13, 5), (33, 65, 17), (3, 4097, 129), (1, 4096, 3)]
M_SWEEP = [(m, 96, 80) for m in range(1, 34)]
LARGE_K = [(16, 8192, 64)]
# Past every cache block of the CPU driver: more rows than one row block (2040 on AVX-512, 480
# fp32 on AVX2) with a remainder that is not a multiple of the micro-kernel's 12 rows, K over two
# kc blocks and odd, N over one column block (1024 bf16 / 512 fp32) per task.
# The second: a single row block, so A's panels are packed for the first column block and
# kept for the others. The third: the same with K % 32 == 0, which bf16 runs on the AMX
# kernel where the CPU has one (a task of at most 256 rows takes K up to 2048 as one block and
# B in blocks of 256 columns; a 13-row last sliver). The fourth: K within 1024, one block
# everywhere. The fifth: bf16 on AMX over its row block of 2048 with a 5-row last sliver,
# K = 1088 as one block and B in blocks of 480 and 70 columns (gemm.cpp, run_block_kin: the
# next A sliver prefetched in the first, 15 calls a sliver, not in the second); with tasks
# over N, A is packed once for the call and shared (pack_a_shared),
# as in the third and fourth. The sixth: too small to wake the pool, so one task walks three
# column blocks and packs the shared A itself. The seventh: a task of at most 256 rows with
# K over 2048 (AMX: 3 kc blocks of 1408 / 1344). The eighth: more than 256 rows with K over
# 2048 (AMX, big_k_blocks: all 300 rows through each of 3 kc blocks of 1408 / 1344, partial
# sums in between). The ninth: fewer rows than one micro-kernel sliver and more than the
# row-streaming path's 8, over several column blocks.
BLOCK_EDGES = [(2053, 1601, 2100), (45, 1601, 2100), (45, 1600, 2100), (45, 992, 2100), (2085, 1088, 1100),
               (16, 32, 2080), (45, 4160, 600), (300, 4160, 100), (9, 64, 2100)]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# PORTABLE_GEMM_ISA's request and the cpu_isa that info() reports when the CPU has it
# (ci/dev.sh test runs the CPU kernel tests once per unit below the CPU's best).
ISA_REQUESTS = {"generic": "generic", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512+bf16",
                "amx": "avx512+bf16+amx"}


def pytest_report_header(config):
    try:
        import portable_gemm
        features = portable_gemm.info()["features"]
    except Exception as e:  # the tests that need the package say why it failed
        return f"portable_gemm: not loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    request = os.environ.get("PORTABLE_GEMM_ISA")
    asked = f" (PORTABLE_GEMM_ISA={request})" if request is not None else ""
    return f"portable_gemm: target {portable_gemm.info()['target']}, CPU units {features['cpu_isa']}{asked}"


def pytest_sessionstart(session):
    """A run that asks for lower CPU units must get them: the kernel library only ever lowers
    its choice, so asking for a unit this CPU lacks would silently test the units below."""
    request = os.environ.get("PORTABLE_GEMM_ISA")
    if request not in ISA_REQUESTS:
        return
    import portable_gemm
    got = portable_gemm.info()["features"]["cpu_isa"]
    if got != ISA_REQUESTS[request]:
        raise pytest.UsageError(f"PORTABLE_GEMM_ISA={request} asks for the {ISA_REQUESTS[request]} kernels, but "
                                f"the CPU kernels run on {got}: this CPU lacks the units asked for")


@pytest.fixture(autouse=True)
def sentinel_outputs():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(prev)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(1234)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    denom = ref.norm().item()
    num = (out - ref).norm().item()
    if denom == 0.0:
        return num
    return num / denom


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: float | None = None,
                 label: str = ""):
    where = f" [{label}]" if label else ""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}{where}"
    assert not torch.isnan(out).any(), f"output holds NaN: an element was never written (sentinel){where}"
    err = rel_err(out, ref)
    limit = tol if tol is not None else TOL[dtype]
    # Element by element too: a wrong tile or row can hide in the norm of a large output.
    # Each element may be off by 4 limits of itself plus 8 of the output's RMS (the floor for
    # elements near zero, whose rounding follows the terms' size, not their sum's).
    dev = (out.double() - ref.double()).abs()
    rms = ref.double().pow(2).mean().sqrt().item() if ref.numel() else 0.0
    bound = limit * (4 * ref.double().abs() + 8 * rms)
    worst = (dev - bound).flatten().argmax().item() if dev.numel() else 0
    assert dev.numel() == 0 or dev.flatten()[worst] <= bound.flatten()[worst], \
        (f"element {worst} (flat index) off by {dev.flatten()[worst].item():.3e} from {ref.flatten()[worst].item():.3e}, "
         f"more than {bound.flatten()[worst].item():.3e} ({dtype}){where}")
    assert err <= limit, f"relative error {err:.3e} > {limit:.1e} ({dtype}){where}"


def act_ref(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(z)
    if activation == "silu":
        return z * torch.sigmoid(z)
    if activation == "gelu":
        return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    return z


def rand(shape, dtype, device="cpu", scale=1.0):
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)


def gemm_ref(a, b, bias=None, activation="none"):
    z = a.double() @ b.double()
    if bias is not None:
        z = z + bias.double()
    return act_ref(z, activation)


def tree_license_files() -> dict[str, bytes]:
    """LICENSE, NOTICE and LICENSES/*.txt of this tree, by path from the repository root: what
    every wheel (.dist-info/licenses and portable_gemm/licenses) and vendored copy carries."""
    files = {p.relative_to(REPO).as_posix(): p.read_bytes()
             for p in [REPO / "LICENSE", REPO / "NOTICE", *(REPO / "LICENSES").glob("*.txt")]}
    assert len(files) >= 6, sorted(files)  # the two and the four projects NOTICE names
    return files


def unpack_int4_ref(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] int64, low nibble first, signed (written independently of
    the package's dequantize_weight)."""
    p = packed.to(torch.int64)
    lo = p & 0xF
    hi = (p >> 4) & 0xF
    lo = torch.where(lo >= 8, lo - 16, lo)
    hi = torch.where(hi >= 8, hi - 16, hi)
    return torch.stack([lo, hi], dim=-1).reshape(p.shape[0], -1)


def dequant_ref(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    qi = q.to(torch.int64) if bits == 8 else unpack_int4_ref(q)
    s = scales.double()
    if group_size:
        s = s.repeat_interleave(group_size, dim=1)
    else:
        s = s[:, None]
    return qi.double() * s


def strided_variants(t: torch.Tensor):
    """Yield (name, view) pairs with the same values as t but other memory layouts."""
    yield "contiguous", t
    yield "transposed", t.mT.contiguous().mT
    big = torch.empty((t.shape[0] + 3, t.shape[1] * 2 + 5), dtype=t.dtype, device=t.device)
    big.fill_(float("nan"))
    view = big[2:2 + t.shape[0], 3:3 + 2 * t.shape[1]:2]
    view.copy_(t)
    yield "offset+step", view


def run_python(code: str, env: dict | None = None, timeout: int = 300,
               unset: tuple[str, ...] = (), args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (loader decisions happen at import time), with env
    added to this process's environment and the variables in unset removed from it. With
    args, the interpreter runs those arguments instead of `-c code` (e.g. ["-m", "pkg"])."""
    full_env = dict(os.environ)
    for name in ("PORTABLE_GEMM_TARGET", *unset):
        full_env.pop(name, None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, *(args if args is not None else ["-c", code])],
                          capture_output=True, text=True, env=full_env, timeout=timeout)

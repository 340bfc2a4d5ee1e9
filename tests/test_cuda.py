"""CUDA-only behaviour: torch's current stream is honoured (non-default streams, CUDA graph
capture and replay), the device guard, and the binding's stream branch."""

import os
import re
from pathlib import Path

import pytest
import torch
from conftest import assert_close, dequant_ref, gemm_ref, rand, run_python

import portable_gemm as pg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_binding_loaded():
    info = pg.info()
    assert info["cuda"]["loaded"], info["cuda"]["reason"]
    want = "Stream::nativeHandle" if info["target"] == "2.13" else "aoti_torch_get_current_cuda_stream"
    assert info["features"]["stream_api"] == want
    want_check = "own_macro" if info["target"] == "2.9" else "STD_CUDA_CHECK"
    assert info["features"]["cuda_error_check"] == want_check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_default_stream(dtype):
    # Large enough that a kernel racing on the wrong stream would read unfinished inputs.
    s = torch.cuda.Stream()
    a0 = rand((2048, 2048), dtype, "cuda")
    b0 = rand((2048, 1024), dtype, "cuda")
    ref = gemm_ref(a0, b0)
    with torch.cuda.stream(s):
        a = a0 * 1.0  # produced on s
        b = b0 * 1.0
        out = pg.gemm(a, b)
        w = rand((1024, 2048), torch.bfloat16, "cuda")
        q, sc = pg.quantize_weight(w, bits=4, group_size=128)
        y = pg.mixed_linear(a[:16].to(torch.bfloat16), q, sc, bits=4, group_size=128)
    s.synchronize()
    assert_close(out, ref, dtype)
    ref_y = a0[:16].to(torch.bfloat16).double() @ dequant_ref(q, sc, 4, 128).cuda().T
    assert_close(y, ref_y, torch.bfloat16)


def test_cuda_graph_capture_and_replay():
    a = rand((64, 256), torch.bfloat16, "cuda")
    b = rand((256, 128), torch.bfloat16, "cuda")
    w = rand((512, 256), torch.bfloat16, "cuda")
    q, sc = pg.quantize_weight(w, bits=8, group_size=64)
    x = rand((4, 256), torch.bfloat16, "cuda")
    pg.gemm(a, b)  # warm-up outside the graph
    pg.mixed_linear(x, q, sc, bits=8, group_size=64)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = pg.gemm(a, b, activation="relu")
        y = pg.mixed_linear(x, q, sc, bits=8, group_size=64)
    for _ in range(2):
        a.copy_(rand((64, 256), torch.bfloat16, "cuda"))
        x.copy_(rand((4, 256), torch.bfloat16, "cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, gemm_ref(a, b, None, "relu"), torch.bfloat16)
        assert_close(y, x.double() @ dequant_ref(q, sc, 8, 64).cuda().T, torch.bfloat16)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_guard_second_gpu():
    a = rand((33, 65), torch.float16, "cuda:1")
    b = rand((65, 17), torch.float16, "cuda:1")
    out = pg.gemm(a, b)
    assert out.device == torch.device("cuda:1")
    assert_close(out, gemm_ref(a, b), torch.float16)


def test_cpu_and_cuda_mixed_is_an_error():
    with pytest.raises(RuntimeError, match="move all inputs to one device"):
        pg.gemm(rand((4, 8), torch.float32, "cuda"), rand((8, 3), torch.float32))
    w = rand((8, 64), torch.bfloat16)
    q, s = pg.quantize_weight(w, bits=8)
    with pytest.raises(RuntimeError, match="move all inputs to one device"):
        pg.mixed_linear(rand((2, 64), torch.bfloat16, "cuda"), q, s, bits=8)


def _cuda_kernels_run(fn) -> list[str]:
    """Names of the CUDA kernels fn() launched (CUPTI through torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _sm90_gemm_built() -> str | None:
    cuda = pg.info()["manifest"]["toolchain"]["cuda"] or {}
    return cuda.get("sm90_gemm") or None


def _is_sm90() -> bool:
    """An sm_90 GPU whose sm_90 kernels are on: PORTABLE_GEMM_DISABLE_SM90 (read by the
    library, as here: unset, empty or 0 leaves them on) sends every GPU to the portable ones."""
    if os.environ.get("PORTABLE_GEMM_DISABLE_SM90", "0") not in ("", "0"):
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# (M, K, N) that qualify for the sm_90 CUTLASS path: partial tiles in M and N (128 x 256
# tiles), K not a multiple of the 64-wide k-block, and a multi-wave problem.
SM90_SHAPES = [(64, 64, 64), (200, 72, 136), (384, 1000, 520), (1024, 512, 2048)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mkn", SM90_SHAPES, ids=str)
def test_tma_eligible_layouts_bias_activation(dtype, mkn):
    # Every layout the sm_90 path takes (b row-major, b = weight.t(), a and b as slices of
    # wider buffers), with bias and each activation run as the in-place second pass. On
    # other GPUs (or a build without CUTLASS) the same cases check the portable kernel.
    m, k, n = mkn
    a0, b0 = rand((m, k), dtype, "cuda"), rand((k, n), dtype, "cuda")
    bias = rand((n,), dtype, "cuda")
    wide_a = torch.full((m, k + 24), float("nan"), dtype=dtype, device="cuda")
    wide_a[:, 8:8 + k] = a0
    weight = b0.t().contiguous()  # [N, K], as nn.Linear stores it
    wide_b = torch.full((k, n + 40), float("nan"), dtype=dtype, device="cuda")
    wide_b[:, 16:16 + n] = b0
    cases = [("contiguous", a0, b0), ("b = weight.t()", a0, weight.t()),
             ("a, b slices (lda, ldb > width)", wide_a[:, 8:8 + k], wide_b[:, 16:16 + n])]
    for name, a, b in cases:
        assert_close(pg.gemm(a, b), gemm_ref(a0, b0), dtype, label=name)
    for activation in ["none", "relu", "silu", "gelu"]:
        out = pg.gemm(a0, weight.t(), bias=bias, activation=activation)
        assert_close(out, gemm_ref(a0, b0, bias, activation), dtype, label=activation)


@pytest.mark.skipif(not _is_sm90(), reason="the CUTLASS path runs on sm_90 (Hopper) only")
def test_sm90_path_is_taken_when_eligible():
    assert _sm90_gemm_built(), "wheel built without the sm_90 CUTLASS GEMM (no CUTLASS headers at build time)"
    a, b = rand((512, 256), torch.bfloat16, "cuda"), rand((256, 384), torch.bfloat16, "cuda")
    names = _cuda_kernels_run(lambda: pg.gemm(a, b))
    assert any("cutlass" in s for s in names), names
    # Not TMA-eligible (a row stride that is not a multiple of 16 bytes): portable kernel.
    a_odd = rand((512, 257), torch.bfloat16, "cuda")[:, :256]
    names = _cuda_kernels_run(lambda: pg.gemm(a_odd, b))
    assert names and not any("cutlass" in s for s in names), names
    assert_close(pg.gemm(a_odd, b), gemm_ref(a_odd, b), torch.bfloat16)


@pytest.mark.parametrize("bits,group", [(4, 128), (4, None), (8, 64), (8, None)],
                         ids=["int4-g128", "int4-chan", "int8-g64", "int8-chan"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [136, 300], ids=lambda m: f"M{m}")
def test_many_rows_mixed_linear_paths(dtype, bits, group, m):
    # M > 16 with groups of whole 64-wide k-blocks: the fused mixed-input kernel on sm_90
    # (its 128-row tile up to M = 256, the 256-row one above; dequantise + matmul elsewhere).
    # Partial tiles, x as a slice of a wider buffer, f32 scales (transposed into x's dtype by
    # the kernel), bias + activation.
    n, k = 200, 384
    w = rand((n, k), torch.float32, "cuda")
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)  # f32 scales
    wd = dequant_ref(q, s, bits, group)
    x0 = rand((m, k), dtype, "cuda")
    wide = torch.full((m, k + 40), float("nan"), dtype=dtype, device="cuda")
    wide[:, 16:16 + k] = x0
    bias = rand((n,), dtype, "cuda")
    for name, x in [("contiguous", x0), ("slice (ldx > K)", wide[:, 16:16 + k])]:
        out = pg.mixed_linear(x, q, s, bits=bits, group_size=group)
        assert_close(out, x0.double() @ wd.T, dtype, label=name)
    for activation in ["relu", "gelu"]:
        out = pg.mixed_linear(x0, q, s, bits=bits, group_size=group, bias=bias, activation=activation)
        ref = gemm_ref(x0, wd.T.to(torch.float64), bias, activation)
        assert_close(out, ref, dtype, label=activation)


# (M, N, K, stream-K on sm_90): each of the six mixed-input kernels of a (dtype, bits) once.
# On sm_90 with M <= 256, few output tiles (N = 264: 3 tiles of 128 weight rows, the last
# partial) over a long K take the stream-K scheduler, which splits each tile's K loop over
# many SMs and adds the fp32 partials through the workspace in K order, so a repeated call
# is bit-identical; many tiles (68 or more for N = 8704) take the persistent one. The tile
# is 64 rows of x wide up to M = 64, 128 up to 128, and at M = 129..256 256 wide where
# N / 128 tiles give a quarter of the SMs one (N = 4352 and 8704 here), else 128. M = 33..64
# reaches the GEMM only above 16 MiB of quantised weight (up to it, the small-M GEMV takes
# it; cuda::sm90_gemm_outruns_gemv), hence the long K of the 64-wide cases. f16 and bf16 x: each has its own kernels.
TILE_CASES = [
    (48, 264, 131072, True), (48, 8704, 4096, False),  # 64 wide
    (100, 264, 8192, True), (100, 8704, 256, False), (256, 264, 8192, True),  # 128 wide
    (256, 4352, 1024, True), (256, 8704, 256, False),  # 256 wide
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group", [(4, 128), (8, None)], ids=["int4-g128", "int8-chan"])
@pytest.mark.parametrize("m,n,k,stream_k", TILE_CASES, ids=lambda v: str(v))
def test_mixed_linear_tile_schedulers(bits, group, m, n, k, stream_k, dtype):
    # Off sm_90 (or without the CUTLASS kernels) the same cases check the other paths.
    w = rand((n, k), torch.float32, "cuda")
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    del w
    x = rand((m, k), dtype, "cuda")
    bias = rand((n,), dtype, "cuda")
    out = pg.mixed_linear(x, q, s, bits=bits, group_size=group, bias=bias, activation="silu")
    ref = gemm_ref(x, dequant_ref(q, s, bits, group).T.to(torch.float64), bias, "silu")
    assert_close(out, ref, dtype)
    again = pg.mixed_linear(x, q, s, bits=bits, group_size=group, bias=bias, activation="silu")
    assert torch.equal(out, again), "two identical calls gave different results"
    if _is_sm90() and _sm90_gemm_built():
        names = _cuda_kernels_run(lambda: pg.mixed_linear(x, q, s, bits=bits, group_size=group))
        cutlass = [name for name in names if "cutlass" in name]
        # the scheduler's type is part of the kernel's (mangled) name
        assert cutlass and all(("StreamK" in name) == stream_k for name in cutlass), names


# Which kernel takes a weight-only call on sm_90, where two could (bench/GPU_NOTES.md, runs
# 55, 57 and 79; cuda::sm90_gemm_outruns_gemv): at M = 17..32 the small-M GEMV unless the
# quantised weight has 48 MiB or more, where the sm_90 GEMM was measured faster, and always
# for int4 with groups of a multiple of 128 (the GEMV's chunk pairs); at M = 33..64 the GEMV
# up to 16 MiB; M <= 16 always the GEMV. Without the sm_90 GEMM the GEMV
# takes M <= 64 at any size (the test after this one). 4096 x 12288 int8 is 48 MiB
# exactly, 8 rows fewer is under; 4096 x 4096 int8 is 16 MiB exactly, 8 rows more is over.
# The 32776 x 8192 weight's 16-bit copy would exceed the binding's 512 MiB limit for
# dequantise + cuBLAS: on sm_90 both M take the fused GEMM, which needs no such copy; off
# it, M = 64 takes the GEMV and M = 100 the library's own GEMM. (M, K, N, bits, group, the
# sm_90 GEMM expected on sm_90; else the GEMV)
ROUTE_CASES = [
    (24, 4096, 12288, 8, None, True), (24, 4096, 12280, 8, None, False),
    (17, 4096, 12288, 8, 128, True), (32, 11008, 4096, 8, None, False),
    (32, 8192, 8192, 4, 128, False), (24, 16384, 8192, 4, 128, False),
    (24, 16384, 8192, 4, None, True), (24, 16384, 8192, 4, 64, True),
    (16, 16384, 8192, 4, 128, False), (64, 8192, 32776, 4, 128, True),
    (100, 8192, 32776, 4, 128, True),
    (48, 4096, 4096, 4, 128, False), (64, 4096, 4096, 8, None, False),
    (64, 4096, 4104, 8, None, True), (40, 11008, 4096, 4, 128, True),
    (33, 2048, 2048, 8, 128, False),
]


@pytest.mark.parametrize("m,k,n,bits,group,sm90", ROUTE_CASES, ids=lambda v: str(v))
def test_mixed_linear_route_small_m_or_sm90(m, k, n, bits, group, sm90):
    # Off sm_90 (or without the CUTLASS kernels) the same cases check the other paths.
    w = rand((n, k), torch.bfloat16, "cuda")
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    del w
    x = rand((m, k), torch.bfloat16, "cuda")
    out = pg.mixed_linear(x, q, s, bits=bits, group_size=group)
    cols = torch.randperm(n, device="cuda")[:1024]  # a float64 reference for 1024 outputs a row
    ref = x.double() @ dequant_ref(q[cols], s[cols], bits, group).T
    assert_close(out[:, cols], ref, torch.bfloat16)
    # The DLPack door takes the same path (cuda::mixed_linear_pooled, scratch from the pool).
    from portable_gemm import dlpack

    def door():
        return dlpack.mixed_linear(x, q, s, bits, group_size=group, stream=torch.cuda.current_stream().cuda_stream)

    out = door()
    torch.cuda.synchronize()
    assert_close(out[:, cols], ref, torch.bfloat16, label="DLPack door")
    if _is_sm90() and _sm90_gemm_built():
        for label, fn in (("torch op", lambda: pg.mixed_linear(x, q, s, bits=bits, group_size=group)),
                          ("DLPack door", door)):
            names = _cuda_kernels_run(fn)
            took_sm90 = any("cutlass" in name for name in names)
            took_gemv = any("gemv_tc" in name for name in names)
            assert (took_sm90, took_gemv) == (sm90, not sm90), (label, names)


# M = 33..64 on a weight above 16 MiB ((11008, 4096) int4 g128, 21.5 MiB): the sm_90 GEMM
# takes it where it applies (ROUTE_CASES), the small-M GEMV everywhere else (other GPUs;
# here PORTABLE_GEMM_DISABLE_SM90=1), through the torch op, whose other path is dequantise +
# cuBLAS, and through the DLPack door, whose other path is dequantise + the library's gemm
# (cuda::mixed_linear_pooled). On the H200 dequantise + cuBLAS took 1.3-3.1x the GEMV's time
# (bench/GPU_NOTES.md, run 59).
def test_mixed_linear_mid_m_large_weight_without_the_sm90_gemm(tmp_path):
    m, k, n = 48, 11008, 4096
    w = rand((n, k), torch.bfloat16, "cuda")
    q, s = pg.quantize_weight(w, bits=4, group_size=128)
    del w
    x = rand((m, k), torch.bfloat16, "cuda")
    cols = torch.randperm(n, device="cuda")[:1024]  # a float64 reference for 1024 outputs a row
    ref = x.double() @ dequant_ref(q[cols], s[cols], 4, 128).T

    torch.save({"x": x.cpu(), "q": q.cpu(), "s": s.cpu()}, tmp_path / "inputs.pt")
    code = f"""
import torch
from torch.profiler import ProfilerActivity, profile
import portable_gemm as pg
from portable_gemm import dlpack
t = {{key: v.cuda() for key, v in torch.load({str(tmp_path / "inputs.pt")!r}).items()}}
calls = {{"op": lambda: pg.mixed_linear(t["x"], t["q"], t["s"], bits=4, group_size=128),
         "door": lambda: dlpack.mixed_linear(t["x"], t["q"], t["s"], 4, group_size=128,
                                             stream=torch.cuda.current_stream().cuda_stream)}}
for label, fn in calls.items():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        y = fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    torch.save(y.cpu(), {str(tmp_path)!r} + f"/y_{{label}}.pt")
    print(label, "GEMV", sum("gemv_tc" in n for n in names), "CUTLASS", sum("cutlass" in n for n in names),
          "DEQUANT", sum("dequantize" in n for n in names), "OF", len(names))
"""
    r = run_python(code, env={"PORTABLE_GEMM_DISABLE_SM90": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for line in r.stdout.splitlines():
        label, *counts = line.split()
        gemv, cutlass, dequant = (int(counts[counts.index(key) + 1]) for key in ("GEMV", "CUTLASS", "DEQUANT"))
        assert gemv >= 1 and cutlass == 0 and dequant == 0, line
        y = torch.load(tmp_path / f"y_{label}.pt").cuda()
        assert_close(y[:, cols], ref, torch.bfloat16, label=f"{label}, sm_90 kernels off")
    assert sorted(line.split()[0] for line in r.stdout.splitlines()) == ["door", "op"], r.stdout


# More rows than the small-M kernels take, through the DLPack door (cuda::mixed_linear_pooled:
# the torch binding's paths with scratch memory from the device's pool): on sm_90 the fused
# CUTLASS GEMM where it applies, elsewhere, and for the arguments it refuses (g32, N % 8 != 0),
# dequantise + the library's dense gemm, never its GEMM with dequantised B tiles (~0.2x
# cuBLAS). Bias and activation go through either epilogue.
DOOR_MANY_ROWS = [(100, 4096, 1024, 4, 128), (100, 4096, 1032, 4, 32), (300, 2048, 2056, 8, None),
                  (65, 4096, 1028, 8, None), (130, 1024, 2048, 8, 64)]


@pytest.mark.parametrize("m,k,n,bits,group", DOOR_MANY_ROWS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_dlpack_mixed_linear_many_rows_paths(m, k, n, bits, group, dtype):
    from portable_gemm import dlpack

    w = rand((n, k), dtype, "cuda")
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    x = rand((m, k), dtype, "cuda")
    bias = rand((n,), dtype, "cuda")

    def door():
        return dlpack.mixed_linear(x, q, s, bits, group_size=group, bias=bias, activation="silu",
                                   stream=torch.cuda.current_stream().cuda_stream)

    names = _cuda_kernels_run(door)
    out = door()
    torch.cuda.synchronize()
    z = x.double() @ dequant_ref(q, s, bits, group).T + bias.double()
    assert_close(out, torch.nn.functional.silu(z), dtype, label="DLPack door")
    assert not any("TcDequantLoader" in name for name in names), names  # not the slow GEMM
    # on sm_90 the dense gemm after dequantising is a CUTLASS kernel too: the dequantise
    # kernel tells the two paths apart
    sm90 = _is_sm90() and _sm90_gemm_built() and (group is None or group % 64 == 0) and n % 8 == 0
    took_dequant = any("dequantize" in name for name in names)
    took_cutlass = any("cutlass" in name for name in names)
    assert (took_cutlass and not took_dequant) if sm90 else took_dequant, names


# out= through the DLPack door on CUDA, on each path of the many-rows rule and the GEMV:
# a contiguous out (bit-equal to the door's own fresh result: the same kernels), rows padded
# to a multiple of 8 (the sm_90 GEMMs write through their leading dimension) and to an odd
# stride (they refuse it: the portable kernels or dequantise + gemm write it). The padding
# holds a NaN sentinel that must survive.
DOOR_OUT_CASES = [(1, 4096, 1024, 4, 128), (16, 2048, 1032, 8, None), (48, 4096, 1024, 4, 32),
                  (100, 4096, 1024, 4, 128), (300, 2048, 2056, 8, None)]


@pytest.mark.parametrize("m,k,n,bits,group", DOOR_OUT_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("pad", [0, 8, 3], ids=["contiguous", "pad8", "pad3"])
def test_dlpack_mixed_linear_out(m, k, n, bits, group, pad):
    from portable_gemm import dlpack

    dtype = torch.bfloat16
    w = rand((n, k), dtype, "cuda")
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    x, bias = rand((m, k), dtype, "cuda"), rand((n,), dtype, "cuda")
    buf = torch.full((m, n + pad), float("nan"), dtype=dtype, device="cuda")
    out = buf[:, :n]
    stream = torch.cuda.current_stream().cuda_stream
    got = dlpack.mixed_linear(x, q, s, bits, group_size=group, bias=bias, activation="silu", stream=stream, out=out)
    assert got is out
    fresh = dlpack.mixed_linear(x, q, s, bits, group_size=group, bias=bias, activation="silu", stream=stream)
    torch.cuda.synchronize()
    z = x.double() @ dequant_ref(q, s, bits, group).T + bias.double()
    assert_close(out, torch.nn.functional.silu(z), dtype, label=f"door out=, pad {pad}")
    assert torch.isnan(buf[:, n:]).all(), "the door wrote past N into out's row padding"
    if pad == 0:
        assert torch.equal(out, fresh)


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (129, 264, 136), (512, 512, 512)], ids=str)
@pytest.mark.parametrize("pad", [0, 8, 3], ids=["contiguous", "pad8", "pad3"])
def test_dlpack_gemm_out(m, n, k, pad):
    from portable_gemm import dlpack

    dtype = torch.bfloat16
    a, b, bias = rand((m, k), dtype, "cuda"), rand((k, n), dtype, "cuda"), rand((n,), dtype, "cuda")
    buf = torch.full((m, n + pad), float("nan"), dtype=dtype, device="cuda")
    out = buf[:, :n]
    got = dlpack.gemm(a, b, bias, "relu", stream=torch.cuda.current_stream().cuda_stream, out=out)
    assert got is out
    torch.cuda.synchronize()
    assert_close(out, gemm_ref(a, b, bias, "relu"), dtype, label=f"door gemm out=, pad {pad}")
    assert torch.isnan(buf[:, n:]).all()


def test_dlpack_out_on_another_device_refused():
    from portable_gemm import dlpack

    x = rand((2, 256), torch.bfloat16, "cuda")
    q, s = pg.quantize_weight(rand((64, 256), torch.bfloat16, "cuda"), bits=8)
    with pytest.raises(ValueError, match="out is on cpu but the operands are on cuda:0"):
        dlpack.mixed_linear(x, q, s, 8, out=torch.empty(2, 64, dtype=torch.bfloat16))


# With out=, the door allocates nothing at M <= 64 (the GEMV), so a CUDA graph can capture it:
# the replay reads x as it is at replay time and writes the same out. N = 1028 adds the
# GEMV's last-rows launch, which overlaps the first on sm_90 (a programmatic dependent
# launch, captured as such).
@pytest.mark.parametrize("n", [1024, 1028])
@pytest.mark.parametrize("m", [1, 16])
def test_dlpack_out_captured_in_a_cuda_graph(m, n):
    from portable_gemm import dlpack

    dtype = torch.bfloat16
    q, s = pg.quantize_weight(rand((n, 2048), dtype, "cuda"), bits=4, group_size=128)
    x = rand((m, 2048), dtype, "cuda")
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (first-call set-up, as torch advises)
        dlpack.mixed_linear(x, q, s, 4, group_size=128, stream=side.cuda_stream, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dlpack.mixed_linear(x, q, s, 4, group_size=128, stream=torch.cuda.current_stream().cuda_stream, out=out)
    for _ in range(2):
        x.copy_(rand((m, 2048), dtype, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, pg.mixed_linear(x, q, s, bits=4, group_size=128))
        assert_close(out.cpu(), x.cpu().double() @ dequant_ref(q.cpu(), s.cpu(), 4, 128).T, dtype)


# The GEMV's last-rows launch may start while the whole blocks' launch runs (sm_90: a
# programmatic dependent launch) and finishes only after it: work queued next on the stream
# must see every row. The door writes into a NaN-filled out and a copy is queued right
# behind it, with no synchronisation in between. This checks the values behind both
# launches as a later kernel reads them; it cannot force the interleaving that a missing
# griddepcontrol.wait would expose (the last rows' one block starts with the first launch's
# last wave and walks as long as its blocks), so the wait's place is argued in the code.
@pytest.mark.parametrize("bits,group", [(4, 128), (8, None)], ids=str)
@pytest.mark.parametrize("m", [1, 16])
def test_gemv_last_rows_launch_keeps_stream_order(m, bits, group):
    from portable_gemm import dlpack

    n, k = 8196, 8192
    q, s = pg.quantize_weight(rand((n, k), torch.bfloat16, "cuda"), bits=bits, group_size=group)
    x = rand((m, k), torch.bfloat16, "cuda")
    stream = torch.cuda.current_stream().cuda_stream
    want = pg.mixed_linear(x, q, s, bits=bits, group_size=group)
    for _ in range(5):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        dlpack.mixed_linear(x, q, s, bits, group_size=group, stream=stream, out=out)
        snap = out.clone()  # queued behind both launches on the same stream
        torch.cuda.synchronize()
        assert torch.equal(snap, want), "a kernel after the GEMV saw rows not yet written"


# The GEMV must read its inputs only after the kernel right before it in the stream has
# finished writing them. Its launches are plain stream launches today; on sm_90 the last
# rows' launch starts beside the whole blocks' (run 67), and run 128 tried every GEMV launch
# as a programmatic dependent launch of the kernel before it (not kept: bench/GPU_NOTES.md).
# Two orders, in a fresh process with the tests' output fill off (its memset before every op
# would stand between the kernels, and did hide run 128's mutation without the wait):
# - the kernel right before the GEMV is a reduction that writes one of x, the weights or the
#   scales only as it ends (a sum over rows that are zero but for one), into a buffer that
#   held NaN or zeros;
# - the kernel right before is a GEMV whose output the next GEMV reads as x. x differs from
#   round to round, so output memory reused from the round before holds other values.
# A GEMV that read its input too early would see the old contents: with run 128's launches
# and no griddepcontrol.wait this failed. N = 8196 also takes the last rows' launch.
_INPUT_ORDER_CHECK = """
import torch, portable_gemm as pg
def rand(shape):
    return torch.randn(shape, dtype=torch.bfloat16, device="cuda")
bad, k, rows = [], 8192, 24
for n in (8192, 8196):
    for m in (1, 16):
        for bits, group in ((4, 128), (8, None)):
            x_src = rand((m, k))
            q_src, s_src = pg.quantize_weight(rand((n, k)), bits=bits, group_size=group)
            want = pg.mixed_linear(x_src, q_src, s_src, bits=bits, group_size=group)
            big = {}
            for name, t in (("x", x_src), ("qweight", q_src), ("scales", s_src)):
                big[name] = torch.zeros((rows, *t.shape), dtype=t.dtype, device="cuda")
                big[name][-1] = t
            for last in ("x", "qweight", "scales"):
                for _ in range(5):
                    dst = {"x": torch.full_like(x_src, float("nan")), "qweight": torch.zeros_like(q_src),
                           "scales": torch.full_like(s_src, float("nan"))}
                    for name in sorted(dst, key=lambda name: name == last):
                        torch.sum(big[name], dim=0, dtype=dst[name].dtype, out=dst[name])
                    out = pg.mixed_linear(dst["x"], dst["qweight"], dst["scales"], bits=bits, group_size=group)
                    torch.cuda.synchronize()
                    if not torch.equal(out, want):
                        bad.append(f"sum writing {last} before int{bits} n={n} m={m}")
        q1, s1 = pg.quantize_weight(rand((k, k)), bits=4, group_size=128)
        q2, s2 = pg.quantize_weight(rand((n, k)), bits=8)
        xs, want = [rand((m, k)) for _ in range(6)], []
        for x in xs:
            h = pg.mixed_linear(x, q1, s1, bits=4, group_size=128)
            torch.cuda.synchronize()
            want.append(pg.mixed_linear(h, q2, s2, bits=8))
            torch.cuda.synchronize()
        for x, w in zip(xs, want):
            h = pg.mixed_linear(x, q1, s1, bits=4, group_size=128)
            y = pg.mixed_linear(h, q2, s2, bits=8)
            del h
            torch.cuda.synchronize()
            if not torch.equal(y, w):
                bad.append(f"GEMV before GEMV n={n} m={m}")
print("\\n".join(bad) or "all in order")
"""


def test_gemv_reads_its_inputs_only_after_the_kernel_before_it():
    env = {"PORTABLE_GEMM_FILL_OUTPUTS": "0"}
    if os.environ.get("PORTABLE_GEMM_TARGET"):  # a forced-target session: the child's too
        env["PORTABLE_GEMM_TARGET"] = os.environ["PORTABLE_GEMM_TARGET"]
    r = run_python(_INPUT_ORDER_CHECK, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "all in order", r.stdout


# N not a multiple of the tensor-core GEMV's block of rows (32; 16 for int8 at M > 16): the
# last N % 32 rows run as one more whole block that ends at row N and shares rows with the
# last block before it; both store them. Every row must be right, the rows before the last
# 32 bit-equal to a run on the whole blocks alone, and no SIMT GEMV may run (its one block
# walked all of K for the last N % 32 rows: 10x bf16 F.linear's time at N = 8196;
# bench/GPU_NOTES.md, runs 61b and 63).
@pytest.mark.parametrize("m", [1, 8, 16, 24, 48, 64])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, None), (4, 32), (8, None), (8, 64)], ids=str)
@pytest.mark.parametrize("n", [33, 1000, 4100])
def test_mixed_linear_gemv_rows_not_a_multiple_of_the_block(m, bits, group, n):
    k = 1024
    w = rand((n, k), torch.bfloat16, "cuda")
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    x = rand((m, k), torch.bfloat16, "cuda")
    names = _cuda_kernels_run(lambda: pg.mixed_linear(x, q, s, bits=bits, group_size=group))
    simt = [name for name in names if re.search(r"gemv_(generic_)?kernel", name)]
    assert any("gemv_tc" in name for name in names) and not simt, names
    out = pg.mixed_linear(x, q, s, bits=bits, group_size=group)
    assert_close(out, x.double() @ dequant_ref(q, s, bits, group).T, torch.bfloat16)
    # Rows before the last 32 are the first launch's alone: bit-equal to a run on the whole
    # blocks as a weight of their own. The shared rows are stored again by the second launch
    # (the same MMAs on the H200, where they also come out bit-equal; checked above against
    # float64 like every row).
    whole = n // 32 * 32
    head = pg.mixed_linear(x, q[:whole].contiguous(), s[:whole].contiguous(), bits=bits, group_size=group)
    assert torch.equal(out[:, :n - 32], head[:, :n - 32])
    assert torch.equal(out, pg.mixed_linear(x, q, s, bits=bits, group_size=group))


# Per-channel scales: on sm_90 the mixed-input kernel reads them as stored when they are in
# x's dtype, contiguous and 16-byte aligned ([N] is then already the [1, N] it wants), and
# transposes them into its workspace otherwise. Both with the stream-K scheduler (M = 100,
# N = 264: a workspace for the partial sums) and without it (N = 8704: as stored, no
# workspace at all, so the call allocates its output and nothing else).
SCALE_FORMS = ["as stored", "other dtype", "strided", "misaligned"]


@pytest.mark.parametrize("form", SCALE_FORMS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(100, 264, 4096), (100, 8704, 256)], ids=["stream-K", "persistent"])
def test_mixed_linear_per_channel_scales_forms(form, bits, dtype, m, n, k):
    w = rand((n, k), dtype, "cuda")
    q, s = pg.quantize_weight(w, bits=bits)  # scales [N] in w's dtype, contiguous
    if form == "other dtype":
        s = s.to(torch.bfloat16 if dtype == torch.float16 else torch.float16)
    elif form == "strided":
        buf = torch.full((n, 2), float("nan"), dtype=s.dtype, device="cuda")
        buf[:, 0] = s
        s = buf[:, 0]
    elif form == "misaligned":
        buf = torch.full((n + 1,), float("nan"), dtype=s.dtype, device="cuda")
        buf[1:] = s
        s = buf[1:]
    x = rand((m, k), dtype, "cuda")
    out = pg.mixed_linear(x, q, s, bits=bits)
    assert_close(out, x.double() @ dequant_ref(q, s, bits, None).T, dtype, label=form)
    if _is_sm90() and _sm90_gemm_built():
        names = _cuda_kernels_run(lambda: pg.mixed_linear(x, q, s, bits=bits))
        cutlass = [name for name in names if "cutlass" in name]
        assert cutlass and all(("StreamK" in name) == (n == 264) for name in cutlass), names
        transposed = any("transpose_scales" in name for name in names)
        assert transposed == (form != "as stored"), names
        # allocation requests of one call: the output, plus a workspace unless none is needed
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        pg.mixed_linear(x, q, s, bits=bits)
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
        assert allocs == (1 if form == "as stored" and n != 264 else 2), allocs


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not _is_sm90(), reason="needs two sm_90 GPUs")
def test_sm90_kernels_on_two_devices():
    # The CUTLASS kernels' shared-memory attribute is set once per device: calls on cuda:0
    # must not leave cuda:1 without it, nor the way back.
    for dev in ["cuda:0", "cuda:1", "cuda:0"]:
        a = rand((256, 512), torch.bfloat16, dev)
        b = rand((512, 256), torch.bfloat16, dev)
        assert_close(pg.gemm(a, b), gemm_ref(a, b), torch.bfloat16, label=dev)
        q, s = pg.quantize_weight(rand((256, 512), torch.bfloat16, dev), bits=4, group_size=128)
        x = rand((100, 512), torch.bfloat16, dev)  # M > 64: the sm_90 GEMM, whatever the weight's size
        out = pg.mixed_linear(x, q, s, bits=4, group_size=128)
        assert out.device == torch.device(dev)
        assert_close(out, x.double() @ dequant_ref(q, s, 4, 128).T, torch.bfloat16, label=dev)


@pytest.mark.skipif(not _is_sm90(), reason="the CUTLASS path runs on sm_90 (Hopper) only")
def test_sm90_mixed_path_is_taken_when_eligible():
    assert _sm90_gemm_built(), "wheel built without the sm_90 CUTLASS kernels (no CUTLASS headers at build time)"
    w = rand((256, 512), torch.bfloat16, "cuda")
    x = rand((100, 512), torch.bfloat16, "cuda")  # M > 64: small weights too
    q, s = pg.quantize_weight(w, bits=4, group_size=128)
    names = _cuda_kernels_run(lambda: pg.mixed_linear(x, q, s, bits=4, group_size=128))
    # fused: a CUTLASS kernel and no dequantisation pass (kernel names may be mangled)
    assert any("cutlass" in n for n in names) and not any("dequantize" in n for n in names), names
    # Groups of 32 do not span a 64-wide k-block: dequantise, then a dense GEMM.
    q32, s32 = pg.quantize_weight(w, bits=4, group_size=32)
    names = _cuda_kernels_run(lambda: pg.mixed_linear(x, q32, s32, bits=4, group_size=32))
    assert any("dequantize" in n for n in names), names
    assert_close(pg.mixed_linear(x, q32, s32, bits=4, group_size=32),
                 x.double() @ dequant_ref(q32, s32, 4, 32).T, torch.bfloat16)


@pytest.mark.skipif(not _is_sm90(), reason="the CUTLASS path runs on sm_90 (Hopper) only")
@pytest.mark.parametrize("value,expect_cutlass", [("1", False), ("0", True)])
def test_disable_sm90_environment_variable(value, expect_cutlass):
    code = """
import torch
from torch.profiler import ProfilerActivity, profile
import portable_gemm as pg
a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
b = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
x = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
q, s = pg.quantize_weight(b.t().contiguous(), bits=4, group_size=128)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    pg.gemm(a, b)
    pg.mixed_linear(x, q, s, bits=4, group_size=128)
    torch.cuda.synchronize()
names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
print("CUTLASS", sum("cutlass" in n for n in names), "OF", len(names))
"""
    r = run_python(code, env={"PORTABLE_GEMM_DISABLE_SM90": value})
    assert r.returncode == 0, r.stderr[-3000:]
    count = int(r.stdout.split("CUTLASS")[1].split()[0])
    assert (count == 2) if expect_cutlass else (count == 0), r.stdout


def test_vendored_copy_runs_its_cuda_binding(tmp_path):
    # A vendored copy (its own namespace and its own renamed kernel library, see
    # test_vendor.py) loads its CUDA binding beside the real package's and computes the same
    # results on the GPU: dense gemm, quantize_weight, mixed_linear at small and large M.
    from portable_gemm._vendor import vendor

    vendor(tmp_path / "pg_copy_cuda", "downstream_cuda")
    code = f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
import portable_gemm as pg
import pg_copy_cuda as pgc
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from conftest import dequant_ref
info = pgc.info()
assert info["cuda"]["loaded"], info["cuda"]["reason"]
for kind in ("cuda", "kernels"):
    assert info["libraries"][kind].startswith({str(tmp_path)!r}), (kind, info["libraries"])
assert pg.info()["libraries"]["kernels"] != info["libraries"]["kernels"]
torch.manual_seed(0)
a = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
b = torch.randn(256, 72, device="cuda", dtype=torch.bfloat16)
y = pgc.gemm(a, b, activation="gelu")
assert torch.equal(y, pg.gemm(a, b, activation="gelu"))
ref = torch.nn.functional.gelu(a.double() @ b.double())
assert ((y.double() - ref).norm() / ref.norm()).item() < 1.2e-2
w = torch.randn(96, 512, device="cuda", dtype=torch.bfloat16)
q, s = pgc.quantize_weight(w, bits=4, group_size=128)
q0, s0 = pg.quantize_weight(w, bits=4, group_size=128)
assert torch.equal(q, q0) and torch.equal(s, s0)
wd = dequant_ref(q.cpu(), s.cpu(), 4, 128).cuda()  # the tests' own float64 reference
for m in (1, 16, 40):
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    out = pgc.mixed_linear(x, q, s, bits=4, group_size=128)
    assert torch.equal(out, pg.mixed_linear(x, q, s, bits=4, group_size=128)), m
    ref = x.double() @ wd.T
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1.2e-2, m
torch.cuda.synchronize()
print("OK")
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")

"""quantize_weight and mixed_linear against independent float64 references."""

import pytest
import torch
from conftest import (ACTIVATIONS, DEVICES, M_SWEEP, TOL, assert_close, act_ref, dequant_ref, rand,
                      strided_variants, unpack_int4_ref)

import portable_gemm as pg

SCHEMES = [(8, None), (8, 32), (8, 128), (4, None), (4, 64), (4, 128)]
SCHEME_IDS = [f"int{b}-g{g or 'chan'}" for b, g in SCHEMES]
X_DTYPES = {"cpu": [torch.float32, torch.float16, torch.bfloat16], "cuda": [torch.float16, torch.bfloat16]}


def quantize_ref(w: torch.Tensor, bits: int, group_size):
    """The documented rule: scale = absmax / qmax in fp32, stored in w's dtype; q = round
    half-even(w / stored scale) in fp32, clamped; a zero group gets scale 0 and q 0."""
    qmax = 2 ** (bits - 1) - 1
    n, k = w.shape
    g = group_size or k
    wg = w.float().reshape(n, k // g, g)
    scale = (wg.abs().amax(-1) / qmax).to(w.dtype)
    s = scale.float()[..., None]
    q = torch.where(s > 0, torch.round(wg / torch.where(s > 0, s, 1)), torch.zeros_like(wg))
    q = q.clamp(-qmax - 1, qmax).reshape(n, k).to(torch.int64)
    return q, (scale if group_size else scale[:, 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group", SCHEMES, ids=SCHEME_IDS)
def test_quantize_matches_rule(device, wdtype, bits, group):
    w = rand((48, 256), wdtype, device)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    q_ref, s_ref = quantize_ref(w.cpu(), bits, group)
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert q.shape == ((48, 256) if bits == 8 else (48, 128))
    assert s.dtype == wdtype and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref)
    got = q.cpu().to(torch.int64) if bits == 8 else unpack_int4_ref(q.cpu())
    assert torch.equal(got, q_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group", SCHEMES, ids=SCHEME_IDS)
def test_exact_weights_round_trip(device, bits, group):
    # w = q * s exactly, with +-qmax in every group: quantise -> dequantise gives w back.
    qmax = 2 ** (bits - 1) - 1
    n, k = 16, 256
    g = group or k
    q = torch.randint(-qmax, qmax + 1, (n, k // g, g))
    q[:, :, 0] = qmax
    q[:, :, 1] = -qmax
    s = torch.rand(n, k // g, 1) + 0.5
    s = (s * 64).round() / 64  # few mantissa bits: exact in every dtype
    w = (q * s).reshape(n, k).float().to(device)
    qw, scales = pg.quantize_weight(w, bits=bits, group_size=group)
    back = dequant_ref(qw.cpu(), scales.cpu(), bits, group)
    assert torch.equal(back, w.cpu().double())


def check_m_list(device, q, s, bits, group, ms, activation="none", parts=None):
    """mixed_linear with a bias and `activation` for every x dtype of the device and every M
    in ms, against a float64 reference; parts names slices of the output channels that are
    checked apart (a path that runs them on another kernel)."""
    n, k = q.shape[0], q.shape[1] * (2 if bits == 4 else 1)
    wd = dequant_ref(q.cpu(), s.cpu(), bits, group)
    for dtype in X_DTYPES[device]:
        bias = rand((n,), dtype, device)
        for m in ms:
            x = rand((m, k), dtype, device)
            out = pg.mixed_linear(x, q, s, bits=bits, group_size=group, bias=bias, activation=activation)
            ref = act_ref(x.cpu().double() @ wd.T + bias.cpu().double(), activation).to(device)
            for name, rows in (parts or {"": slice(0, n)}).items():
                assert_close(out[:, rows], ref[:, rows], dtype, TOL[dtype],
                             label=f"{dtype} K={k} M={m} {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sdtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (8, 128), (4, None), (4, 32), (4, 128)],
                         ids=lambda v: str(v))
def test_dequantize_weight_matches_reference(device, sdtype, bits, group):
    # Every byte value of qweight (int8 -128..127; int4 both nibbles -8..7) with random
    # scales (randn: full fp32 mantissas and negatives; every fifth 0), odd N. Exact: q * s is exact in fp64
    # (dequant_ref) and, for fp16 / bf16 scales (<= 11 + 8 significant bits), in fp32 too,
    # so every output dtype is one correct rounding of the exact product. For fp32 scales the
    # fp32 product is that product rounded once to fp32 (IEEE multiplication), hence equal to
    # dequant_ref rounded to fp32; float64 output is computed in float64, the exact product.
    # fp16 / bf16 output from fp32 scales rounds twice (fp32, then the narrow dtype) and is
    # not checked here.
    for n, k in [(1, 128), (7, 256), (33, 384), (64, 128)]:
        nbytes = k if bits == 8 else k // 2
        q = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8)
        q.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[:q.numel()]
        if bits == 8:
            q = q.view(torch.int8)
        groups = k // group if group else 1
        s = torch.randn(n, groups) * 0.01
        s.view(-1)[::5] = 0
        s = (s if group else s[:, 0]).to(sdtype)
        q, s = q.to(device), s.to(device)
        exact = dequant_ref(q.cpu(), s.cpu(), bits, group)
        out_dtypes = [None, torch.float32, torch.float64] + ([] if sdtype == torch.float32 else
                                                              [torch.float16, torch.bfloat16])
        for dtype in out_dtypes:
            got = pg.dequantize_weight(q, s, bits=bits, group_size=group, dtype=dtype)
            want_dtype = dtype or sdtype
            label = f"N={n} K={k} scales {sdtype} out {want_dtype}"
            assert got.dtype == want_dtype and got.shape == (n, k) and got.device == q.device, label
            got = got.cpu()
            assert torch.equal(got, exact.to(want_dtype)), label


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group", SCHEMES, ids=SCHEME_IDS)
def test_mixed_linear_m_sweep(device, bits, group):
    n, k = 80, 256
    w = rand((n, k), torch.bfloat16, device)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    wd = dequant_ref(q.cpu(), s.cpu(), bits, group)
    for dtype in X_DTYPES[device]:
        # 48 / 49 and 128 / 129: AVX2's dq path, where it runs, / the dense path (on Zen 1
        # cores at 128; on the later Zen cores with PORTABLE_GEMM_AVX2_DQ=1, as isa-paths runs)
        for m in [mk[0] for mk in M_SWEEP] + [48, 49, 64, 128, 129, 200]:
            x = rand((m, k), dtype, device)
            out = pg.mixed_linear(x, q, s, bits=bits, group_size=group)
            assert_close(out, (x.cpu().double() @ wd.T).to(device), dtype, TOL[dtype],
                         label=f"{dtype} M={m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group", SCHEMES, ids=SCHEME_IDS)
@pytest.mark.parametrize("k", [640, 1152])
def test_mixed_linear_k_blocks(device, bits, group, k):
    """bf16 x with 17-96 rows and K over 5 or 9 dequantised blocks of 128 k: on AMX CPUs
    amx_linear pipelines the blocks through two buffers, the tile steps of one block issued
    while the next is dequantised, and takes 33-96 rows in even chunks of at most 32 (33 as
    17 + 16, 80 as 27 + 27 + 26).
    N = 100 leaves the last block of 32 channels partly empty. Elsewhere the same shapes
    check the other paths."""
    n = 100
    w = rand((n, k), torch.bfloat16, device)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    wd = dequant_ref(q.cpu(), s.cpu(), bits, group)
    for m in (17, 25, 32, 33, 47, 64, 80, 96):
        x = rand((m, k), torch.bfloat16, device)
        out = pg.mixed_linear(x, q, s, bits=bits, group_size=group)
        assert_close(out, (x.cpu().double() @ wd.T).to(device), torch.bfloat16, TOL[torch.bfloat16],
                     label=f"M={m} K={k}")


@pytest.mark.parametrize("bits,group,k", [(8, None, 4224), (8, None, 4225), (4, None, 4224), (4, 128, 4224),
                                           (8, 64, 4224)], ids=lambda v: str(v))
def test_mixed_linear_dense_k_blocks(bits, group, k):
    """The CPU's dense path (M over the small-M and AMX routes): per channel the packers write
    the integers and the GEMM's epilogue multiplies each column by its scale, before the bias
    and the activation; groups are applied in the packers. M = 130 and 256 are tasks of at
    most 256 rows (on AMX: K in blocks of at most 2048, here 3 of 1408, and B in
    blocks of 256 columns, 550 a task on 2 threads); M = 300 passes all its rows through
    each of those K blocks with B in blocks of 352 and 198 columns (gemm.cpp, big_k_blocks:
    the next A sliver prefetched in the first, 11 calls a sliver, not in the second).
    K = 4225 (int8 only: int4 needs an even K) leaves the AMX kernel and the fused packer, so
    the row-by-row packer writes the integers. x in each CPU dtype: f32 and f16 x take the
    fp32 kernels and their packer (on AVX-512, 550 columns a task on 2 threads: a column
    block of 512 and one of 38 inside each kc block of A)."""
    n = 1100
    q, s = pg.quantize_weight(rand((n, k), torch.float32), bits=bits, group_size=group)
    wd = dequant_ref(q, s, bits, group)
    for dtype in X_DTYPES["cpu"]:
        bias = rand((n,), dtype, "cpu")
        for m in (130, 256, 300):
            x = rand((m, k), dtype, "cpu")
            out = pg.mixed_linear(x, q, s, bits=bits, group_size=group, bias=bias, activation="silu")
            ref = act_ref(x.double() @ wd.T + bias.double(), "silu")
            assert_close(out, ref, dtype, TOL[dtype], label=f"{dtype} M={m} K={k}")


def _int4_group(k: int) -> int | None:
    """int4's group for an odd-shape case: 32 where it divides K, else 4 (the K = 21844 ...
    cases of AVX2's 4 MiB edge), else per channel: the id says which one runs."""
    return 32 if k % 32 == 0 else 4 if k % 4 == 0 else None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group,mnk", [
    (bits, group if bits == 8 else _int4_group(mnk[2]), mnk)
    for bits, group in [(8, None), (4, 32)]
    for mnk in [(1, 1, 2), (7, 13, 64), (33, 65, 96), (5, 3, 4096), (40, 17, 130), (24, 11, 129),
                (17, 35, 1030), (9, 21, 160),
                # x as fp32 just within / just over the 4 MiB of AVX2's small_rows_dq_avx2
                # (M = 48 where it runs, on the later Zen cores with PORTABLE_GEMM_AVX2_DQ=1; 64
                # on Zen 1 cores)
                (48, 9, 21844), (48, 9, 21848), (64, 9, 16376), (64, 9, 16400)]
    if bits == 8 or mnk[2] % 2 == 0  # int4 needs an even K (test_bad_input checks the error)
] + [  # groups of an odd number of 32-k steps, one across a 256-k block (the AMX path's steps)
    (bits, 96, mnk) for bits in (4, 8) for mnk in [(8, 70, 288), (20, 40, 384)]
], ids=lambda v: str(v))
def test_mixed_linear_odd_shapes(device, bits, group, mnk):
    m, n, k = mnk
    dtype = torch.bfloat16
    w = rand((n, k), dtype, device)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    x = rand((m, k), dtype, device)
    ref = x.cpu().double() @ dequant_ref(q.cpu(), s.cpu(), bits, group).T
    assert_close(pg.mixed_linear(x, q, s, bits=bits, group_size=group), ref.to(device), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mixed_linear_bias_activation(device, activation):
    dtype = torch.float16
    n, k = 48, 128
    w = rand((n, k), dtype, device)
    q, s = pg.quantize_weight(w, bits=4, group_size=64)
    x, bias = rand((9, k), dtype, device), rand((n,), dtype, device)
    ref = act_ref(x.cpu().double() @ dequant_ref(q.cpu(), s.cpu(), 4, 64).T + bias.cpu().double(), activation)
    out = pg.mixed_linear(x, q, s, bits=4, group_size=64, bias=bias, activation=activation)
    assert_close(out, ref.to(device), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_linear_layouts_and_batch(device):
    dtype = torch.bfloat16
    n, k = 40, 128
    w = rand((n, k), dtype, device)
    q, s = pg.quantize_weight(w, bits=8, group_size=32)
    wd = dequant_ref(q.cpu(), s.cpu(), 8, 32)
    x0 = rand((21, k), dtype, device)
    ref = (x0.cpu().double() @ wd.T).to(device)
    for name, x in strided_variants(x0):
        assert_close(pg.mixed_linear(x, q, s, bits=8, group_size=32), ref, dtype, label=name)
    # non-contiguous qweight / scales (column-major copies) and a batched x
    q_cm = q.mT.contiguous().mT
    s_cm = s.mT.contiguous().mT
    assert_close(pg.mixed_linear(x0, q_cm, s_cm, bits=8, group_size=32), ref, dtype, label="col-major q")
    xb = x0[:20].reshape(4, 5, k)
    out = pg.mixed_linear(xb, q, s, bits=8, group_size=32)
    assert out.shape == (4, 5, n)
    assert_close(out.reshape(20, n), ref[:20], dtype, label="batched")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sdtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,group", [(4, None), (4, 128), (4, 32), (8, None), (8, 64), (8, 32)],
                         ids=lambda v: str(v))
def test_mixed_linear_small_m_scale_dtypes(device, sdtype, bits, group):
    # Every scales dtype with every activation dtype at M <= 16 (the CUDA tensor-core GEMV
    # is compiled per scales type; groups of 128+ scale each chunk's sum, smaller ones are
    # folded into the weight), K = 2048 so that each of its warps walks several chunks,
    # N = 72: two whole 32-row blocks and an 8-row tail, which the CUDA path sends to another
    # kernel; the tail is checked on its own, with a bias and an activation.
    q, s = pg.quantize_weight(rand((72, 2048), torch.float32, device), bits=bits, group_size=group)
    # M = 3 and 7: the CPU blocks of 3 rows of x
    check_m_list(device, q, s.to(sdtype), bits, group, (1, 3, 5, 7, 12, 16), activation="silu",
                 parts={"blocks": slice(0, 64), "tail": slice(64, 72)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [None, 128, 64, 32], ids=lambda g: f"g{g or 'chan'}")
def test_mixed_linear_small_m_int4_chunk_sizes(device, group):
    # The CUDA tensor-core GEMV takes int4 at M = 9..16 in half chunks (8-byte pieces, x
    # prefetched a chunk ahead; groups of 64 then scale each chunk's sum) up to K = 8192, and
    # above that in whole chunks (bench/GPU_NOTES.md, run 39) unless the half chunks pair up
    # (per channel, g128: run 77): K on both sides of that bound, at M = 8 (the one-tile
    # kernel), 9 and 16, with a bias.
    for k in (8192, 8320):
        q, s = pg.quantize_weight(rand((64, k), torch.float32, device), bits=4, group_size=group)
        check_m_list(device, q, s, 4, group, (8, 9, 16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [None, 128, 256, 384, 64], ids=lambda g: f"g{g or 'chan'}")
def test_mixed_linear_small_m_int4_chunk_pairs(device, group):
    # The CUDA tensor-core GEMV takes int4 half chunks at M = 9..16 in pairs where one scale
    # covers a whole chunk (per channel, groups of a multiple of 128): each warp multiplies
    # both halves of a whole chunk and scales their sum once (tcv_pair). Groups of 1, 2 and 3
    # whole chunks (the scale counters step over 8 whole chunks a warp: 8, 4 and 2 groups
    # and 256 k), groups of 64 (half chunks without pairs), K = 128 (one pair: one warp of
    # the 8 works) and K = 2304 (18 pairs over 8 warps: the last round is partial), M = 9, 16
    # and 24 (two slices of x), N = 72 (the 8-row tail runs on its own launch).
    for k in ((128, 2304) if group is None or group <= 128 else (2304,)):
        q, s = pg.quantize_weight(rand((72, k), torch.float32, device), bits=4, group_size=group)
        check_m_list(device, q, s, 4, group, (9, 16, 24), activation="silu",
                     parts={"blocks": slice(0, 64), "tail": slice(64, 72)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group,k", [
    (4, None, 9856), (4, 128, 9856), (4, 32, 9856), (8, None, 6336), (8, 64, 6336), (8, 16, 6336),
], ids=lambda v: str(v))
def test_mixed_linear_small_m_long_k(device, bits, group, k):
    # Long rows on the small-M paths: the CUDA tensor-core GEMV's 8 warps split K in chunks
    # (128 k of int4, 64 of int8), so at K = 9856 (77 int4 chunks; at M > 8 whole chunks for
    # g32 since K > 8192, half chunks in pairs for g128 and per channel) and K = 6336 (99 int8 chunks) every warp walks 9-13 chunks, through
    # both of its register stages several times, and the last round of chunks is partial.
    # N = 96: three blocks of 32 rows. Groups that scale each chunk's sum (int4 g128, int8
    # g64, per channel) and groups folded into the weights (int4 g32, int8 g16); M on both
    # sides of 8.
    q, s = pg.quantize_weight(rand((96, k), torch.float32, device), bits=bits, group_size=group)
    check_m_list(device, q, s, bits, group, (1, 5, 8, 9, 16))


@pytest.mark.parametrize("group", [None, 64, 128, 256, 512], ids=lambda g: f"g{g or 'chan'}")
def test_mixed_linear_int4_one_row_offset_form(group):
    # int4 at M = 1 with a bf16 or f16 output on AVX2-only CPUs runs small_block_avx2_i4: x
    # permuted per 64 k, every weight as the fp32 1.0625 + q / 128, and the offset taken off
    # by per-segment sums of x (the groups, or 256 k per channel). On other CPUs the same
    # cases check the blocks they run. K: one 64-k step; per channel a tail past the last
    # whole 64 (100, 2340) and several segments; x random, with a large common offset (the
    # offset sums cancel most of each partial sum), with |x| near 2^99 (still this path) and
    # near 2^101 (the fallback, where those sums could overflow); f32 x (the other blocks).
    ks = {None: (64, 100, 2340), 64: (64, 2304), 128: (128, 2304), 256: (2304,), 512: (2560,)}[group]
    for k in ks:
        q, s = pg.quantize_weight(rand((70, k), torch.float32), bits=4, group_size=group)
        wd = dequant_ref(q, s, 4, group)
        cases = [(torch.bfloat16, 1.0, 0.0), (torch.float16, 1.0, 0.0), (torch.float16, 1.0, 50.0),
                 (torch.bfloat16, 2.0 ** 99, 0.0), (torch.bfloat16, 2.0 ** 101, 0.0), (torch.float32, 1.0, 3.0)]
        for dtype, scale, offset in cases:
            x = (torch.randn(1, k) * scale + offset).to(dtype)
            out = pg.mixed_linear(x, q, s, bits=4, group_size=group)
            ref = x.double() @ wd.T
            assert torch.isfinite(out).all(), f"K={k} {dtype} scale {scale} offset {offset}"
            assert_close(out, ref, dtype, TOL[dtype], label=f"K={k} {dtype} scale {scale} offset {offset}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [None, 64, 16], ids=lambda g: f"g{g or 'chan'}")
def test_mixed_linear_small_m_int8_every_value_exact(device, group):
    # Every int8 value through the small-M paths, one k at a time: row m of x is one-hot at
    # k_m, so y[m, n] is the single product q[n, k_m] * s (scales of 6 significant bits), exact
    # before the output's one rounding, in every x dtype. The CUDA GEMV turns int8 into bf16
    # with integer ops and pairs k with k + 2 (x permuted to match, dq8_bf16_split): k_m walks
    # every residue mod 4 and every word of a lane's 16-byte piece, so a weight paired with
    # the wrong x shows. Groups of 64 scale each chunk's sum there, groups of 16 are folded
    # into the weight; M = 1, 8 (one x tile), 9 and 16 (two).
    n, k = 64, 512
    q = ((torch.arange(n)[:, None] * 37 + torch.arange(k)[None, :] * 11) % 256 - 128).to(torch.int8)
    g = group or k
    gen = torch.Generator().manual_seed(7)
    s = torch.randint(1, 64, (n, k // g), generator=gen).float() / 32
    s = s if group else s[:, 0]
    for dtype in X_DTYPES[device]:
        for m in (1, 8, 9, 16):
            km = torch.arange(m) * 33 % k
            x = torch.zeros(m, k, dtype=dtype)
            x[torch.arange(m), km] = 1
            want = q[:, km].T.double() * (s[:, km // g].T if group else s[None, :]).double()
            got = pg.mixed_linear(x.to(device), q.to(device), s.to(device), bits=8, group_size=group)
            assert torch.equal(got.cpu(), want.to(dtype)), f"{dtype} M={m}"
    # the rows of the largest M pick out every int8 value
    assert q[:, torch.arange(16) * 33 % k].unique().numel() == 256


@pytest.mark.parametrize("group,k", [(128, 128 * 7), (256, 256 * 5), (384, 384 * 3)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("sdtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_mixed_linear_int4_group_windows_exact(group, k, sdtype):
    # int4 with groups of whole 128-k blocks at 2..8 rows of x (on AMX CPUs amx_linear, its
    # blocks of one group each; elsewhere the FMA or nibble blocks). Row m of x is one-hot at
    # k_m, the k_m in different groups and at different places of their 64-k blocks (int4
    # packs x in a permuted order there), so y[m, n] is the single product
    # q[n, k_m] * s[n, k_m // group], exact (scales of 6 significant bits), whichever the
    # path's rounding of the scaled weight; N = 72 is a channel block of 64 and a part; x
    # also strided (packed one value at a time). Written for group sums kept apart in the
    # accumulators' spare columns, a form refuted (bench/CPU_NOTES.md 65); amx_linear reading
    # each block's scales one group early failed every case here.
    n = 72
    gen = torch.Generator().manual_seed(11)
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    s = (torch.randint(1, 64, (n, k // group), generator=gen).float() / 32).to(sdtype)
    wd = dequant_ref(q, s, 4, group)
    for m in (2, 3, 4, 5, 8):
        km = (torch.arange(m) * (k // m + 37) + 5) % k
        assert km.div(group, rounding_mode="floor").unique().numel() > 1
        for layout, x in strided_variants(torch.zeros(m, k, dtype=torch.bfloat16)):
            x[torch.arange(m), km] = 1
            got = pg.mixed_linear(x, q, s, bits=4, group_size=group)
            want = wd[:, km].T
            assert torch.equal(got, want.to(torch.bfloat16)), f"M={m} {layout}"
    # and a dense x, against the float64 reference
    x = torch.randn(8, k, generator=gen).to(torch.bfloat16)
    for m in (2, 4, 5, 8):
        assert_close(pg.mixed_linear(x[:m], q, s, bits=4, group_size=group),
                     x[:m].double() @ wd.T, torch.bfloat16, label=f"dense x, M={m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group,k", [
    (4, 128, 2048), (4, None, 2048), (4, 32, 2048), (4, None, 8320), (4, 32, 8320),
    (8, None, 2048), (8, 16, 1024), (8, 64, 2048),
], ids=lambda v: str(v))
def test_mixed_linear_sliced_m(device, bits, group, k):
    # 16 < M <= 64 with the CUDA tensor-core GEMV's preconditions (on sm_90 and above 32
    # rows, a weight of at most 16 MiB, as here) runs on that GEMV in one launch: int4 over x
    # in slices of 16 rows (runs 47 and 57; four x tiles a pass were slower, run 73), int8
    # with four 8-row x tiles over 16-row weight blocks, in slices of 32 rows (runs 54 and
    # 57): M on both sides of the slice edges and of the limit (65 takes the many-row path),
    # half chunks (K = 2048) and whole ones (int4 K = 8320), per channel, groups that scale
    # chunk sums (int4 g128, int8 g64) and groups folded into the weights (int4 g32, int8
    # g16). N = 72: whole blocks of 32 (int4) or 16 (int8) rows and an 8-row
    # tail, which the CUDA path runs as one more whole block ending at row N; the tail is
    # checked on its own. Bias and activation (the epilogue maps each slice's or tile's rows).
    q, s = pg.quantize_weight(rand((72, k), torch.float32, device), bits=bits, group_size=group)
    check_m_list(device, q, s, bits, group, (17, 24, 31, 32, 33, 40, 48, 63, 64, 65), activation="gelu",
                 parts={"blocks": slice(0, 64), "tail": slice(64, 72)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group,k", [
    (4, 128, 2048), (4, 24, 1200), (4, 6, 1026), (4, None, 1030),
    (8, 64, 2048), (8, 20, 1000), (8, 10, 1030), (8, None, 2053),
], ids=lambda v: str(v))
def test_mixed_linear_dense_path_groups(device, bits, group, k):
    # M = 48 with bf16 x takes the dense path, whose CPU B packer dequantises a 16-row slab
    # at a time from 32-bit words of the quantised rows when every scale group is whole
    # words (int4: 8 values, int8: 4) and the K block is even, and row by row otherwise:
    # groups of 6 and 10 straddle words, K = 2053 splits into blocks of 688, 688 and 677.
    # N = 50 leaves a slab of 2 rows; every scales dtype.
    n, m = 50, 48
    w = rand((n, k), torch.float32, device)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    for sdtype in (torch.float32, torch.float16, torch.bfloat16):
        s_t = s.to(sdtype)
        wd = dequant_ref(q.cpu(), s_t.cpu(), bits, group)
        x = rand((m, k), torch.bfloat16, device)
        out = pg.mixed_linear(x, q, s_t, bits=bits, group_size=group)
        assert_close(out, (x.cpu().double() @ wd.T).to(device), torch.bfloat16,
                     TOL[torch.bfloat16], label=f"scales {sdtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits,group", [(4, 128), (8, None)], ids=str)
def test_mixed_linear_dense_path_column_blocks(device, dtype, bits, group):
    # Past the CPU driver's column block (1024 columns per thread) and kc block with one block
    # of rows: x's panels are packed for the first column block and kept for the others.
    m, k, n = 45, 2048, 2100
    w = rand((n, k), torch.float32, device)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group)
    x = rand((m, k), dtype, device)
    wd = dequant_ref(q.cpu(), s.cpu(), bits, group)
    assert_close(pg.mixed_linear(x, q, s, bits=bits, group_size=group),
                 (x.cpu().double() @ wd.T).to(device), dtype, TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_linear_scales_dtype_independent(device):
    # fp32 scales with bf16 activations (a common export format)
    n, k = 32, 128
    w = rand((n, k), torch.float32, device)
    q, s = pg.quantize_weight(w, bits=4, group_size=None)
    x = rand((3, k), torch.bfloat16, device)
    ref = x.cpu().double() @ dequant_ref(q.cpu(), s.cpu(), 4, None).T
    assert_close(pg.mixed_linear(x, q, s, bits=4), ref.to(device), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_linear_empty(device):
    dtype = torch.float16
    w = rand((6, 8), dtype, device)
    q, s = pg.quantize_weight(w, bits=8)
    assert pg.mixed_linear(rand((0, 8), dtype, device), q, s, bits=8).shape == (0, 6)
    q0, s0 = pg.quantize_weight(rand((0, 8), dtype, device), bits=8)
    assert q0.shape == (0, 8) and s0.shape == (0,)
    assert pg.mixed_linear(rand((3, 8), dtype, device), q0, s0, bits=8).shape == (3, 0)

"""The Python layer on its own: fake kernels that refuse what the real ops refuse, the
wrappers' argument checks, dequantize_weight, QuantizedLinear's constructor, and the loader's
handling of damaged or unusual installations (in fresh interpreters on private copies of
the installed package, built with test_faults.py's helpers)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import REPO, dequant_ref, rand, run_python
from test_bad_input import ALL as BAD_INPUTS
from test_faults import (INSTALLED, _cpu_bindings, _manifest, _targets_newest_first, _write_manifest,
                         all_reports, copy_package, script)
from torch._subclasses.fake_tensor import FakeTensorMode

import portable_gemm as pg
from portable_gemm._loader import check_library_file

f32, bf16 = torch.float32, torch.bfloat16


def _error(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the type is part of what is compared
        return type(e), str(e)
    return None, None


# ---- 1, 2: fake kernels ----------------------------------------------------------------

@pytest.mark.parametrize("op,name,call,match", BAD_INPUTS, ids=[f"{c[0]}: {c[1]}" for c in BAD_INPUTS])
def test_fake_refuses_what_the_op_refuses(op, name, call, match):
    # The same call under FakeTensorMode (what torch.compile traces with) raises the same
    # error, word for word, as the real op.
    real_type, real_msg = _error(call)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_type, fake_msg = _error(call)
    assert real_type is not None and fake_type is real_type, (real_type, real_msg, fake_type, fake_msg)
    assert real_msg == fake_msg, (real_msg, fake_msg)


def test_meta_input_mixed_with_cpu_is_refused():
    # (was a CPU tensor of uninitialised memory: the meta kernel allocated like `a`)
    a, b = rand((4, 8), f32), rand((8, 3), f32)
    with pytest.raises(RuntimeError, match=r"portable_gemm.gemm: b is on meta but a is on cpu; move all inputs"):
        pg.gemm(a, b.to("meta"))
    with pytest.raises(RuntimeError, match=r"bias is on meta but a is on cpu"):
        pg.gemm(a, b, bias=rand((3,), f32).to("meta"))
    w = rand((8, 64), bf16)
    q, s = pg.quantize_weight(w, bits=8)
    x = rand((2, 64), bf16)
    with pytest.raises(RuntimeError, match=r"portable_gemm.mixed_linear: qweight is on meta but x is on cpu"):
        pg.mixed_linear(x, q.to("meta"), s, bits=8)
    with pytest.raises(RuntimeError, match=r"scales is on meta but x is on cpu"):
        pg.mixed_linear(x, q, s.to("meta"), bits=8)


def test_fake_mixed_devices_are_refused():
    # (was a cuda result where torch.mm raises)
    with FakeTensorMode():
        a, b = torch.empty(4, 8, device="cuda"), torch.empty(8, 3)
        with pytest.raises(RuntimeError, match=r"b is on cpu but a is on cuda:0; move all inputs to one device"):
            pg.gemm(a, b)
        x = torch.empty(2, 64, device="cuda", dtype=bf16)
        q, s = torch.empty(8, 32, dtype=torch.uint8, device="cuda"), torch.empty(8, 2, dtype=bf16)
        with pytest.raises(RuntimeError, match=r"scales is on cpu but x is on cuda:0"):
            pg.mixed_linear(x, q, s, bits=4, group_size=32)
        with pytest.raises(RuntimeError, match=r"bias is on cpu but x is on cuda:0"):
            pg.mixed_linear(x, q, torch.empty(8, 2, dtype=bf16, device="cuda"), bits=4, group_size=32,
                            bias=torch.empty(8, dtype=bf16))


def test_fake_shapes_match_the_op():
    w = rand((16, 64), bf16)
    x, a, b = rand((2, 3, 64), bf16), rand((5, 12), f32), rand((12, 7), f32)
    for call in (lambda: pg.gemm(a, b, bias=rand((7,), f32), activation="gelu"),
                 lambda: pg.quantize_weight(w, bits=4, group_size=32),
                 lambda: pg.mixed_linear(x, *pg.quantize_weight(w, bits=8), bits=8)):
        real = call()
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = call()
        for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
            assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)


# ---- 3: quantize_weight is not differentiable -------------------------------------------

@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_quantize_weight_outputs_never_require_grad(bits, group):
    w = rand((16, 64), f32).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q, s = pg.quantize_weight(w, bits=bits, group_size=group)
        direct = torch.ops.portable_gemm.quantize_weight(w, bits, group or 0)
    assert not caught, [str(c.message) for c in caught]
    for t in (q, s, *direct):
        assert not t.requires_grad and t.grad_fn is None
    torch.library.opcheck(torch.ops.portable_gemm.quantize_weight.default, (w, bits, group or 0))


# ---- 4: dequantize_weight -----------------------------------------------------------------

@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (4, None), (4, 32)])
def test_dequantize_weight_matches_reference(bits, group):
    q, s = pg.quantize_weight(rand((12, 64), bf16), bits=bits, group_size=group)
    out = pg.dequantize_weight(q, s, bits=bits, group_size=group, dtype=torch.float64)
    assert torch.equal(out, dequant_ref(q, s, bits, group))
    assert pg.dequantize_weight(q, s, bits=bits, group_size=group).dtype == bf16


def test_dequantize_weight_of_no_rows():
    # (was "cannot reshape tensor of 0 elements into shape [0, -1]")
    q, s = pg.quantize_weight(torch.empty(0, 64), bits=4, group_size=32)
    assert pg.dequantize_weight(q, s, bits=4, group_size=32).shape == (0, 64)


def dequant_cases():
    w = rand((8, 64), f32)
    q8, s8 = pg.quantize_weight(w, bits=8)
    q4, s4 = pg.quantize_weight(w, bits=4, group_size=32)
    yield "bits", lambda: pg.dequantize_weight(q8, s8, bits=3), RuntimeError, r"bits must be 4 or 8, got 3"
    yield "int8 as int4", lambda: pg.dequantize_weight(q8, s8, bits=4), RuntimeError, \
        r"dequantize_weight: bits=4 needs qweight of dtype uint8, got int8"
    yield "uint8 as int8", lambda: pg.dequantize_weight(q4, s4, bits=8, group_size=32), RuntimeError, \
        r"bits=8 needs qweight of dtype int8, got uint8"
    yield "qweight rank", lambda: pg.dequantize_weight(q8.reshape(-1), s8, bits=8), RuntimeError, r"qweight must be 2-D"
    yield "group divides", lambda: pg.dequantize_weight(q8, s8, bits=8, group_size=48), RuntimeError, \
        r"group_size 48 must divide K = 64"
    yield "group negative", lambda: pg.dequantize_weight(q8, s8, bits=8, group_size=-32), ValueError, \
        r"group_size must be None \(per channel\) or a positive int"
    yield "scales shape", lambda: pg.dequantize_weight(q4, s4, bits=4, group_size=16), RuntimeError, \
        r"scales must have shape \[N, K / group_size\] = \[8, 4\] for group_size=16"
    yield "per-channel scales", lambda: pg.dequantize_weight(q8, s8[:4], bits=8), RuntimeError, \
        r"scales must have shape \[N\] = \[8\]"
    yield "scales dtype", lambda: pg.dequantize_weight(q8, s8.to(torch.int32), bits=8), RuntimeError, \
        r"scales must be float32, float16 or bfloat16, got int32"
    yield "scales device", lambda: pg.dequantize_weight(q8, s8.to("meta"), bits=8), RuntimeError, \
        r"scales is on meta but qweight is on cpu"


DEQUANT = list(dequant_cases())


@pytest.mark.parametrize("name,call,exc,match", DEQUANT, ids=[c[0] for c in DEQUANT])
def test_dequantize_weight_bad_input(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---- 5: a non-tensor where a tensor is required -------------------------------------------

def type_cases():
    a, b = rand((4, 8), f32), rand((8, 3), f32)
    w = rand((8, 64), f32)
    q, s = pg.quantize_weight(w, bits=8)
    x = rand((2, 64), f32)
    yield "gemm a None", lambda: pg.gemm(None, b), r"portable_gemm.gemm: a must be a torch.Tensor, got None"
    yield "gemm a list", lambda: pg.gemm([[1.0] * 8] * 4, b), r"gemm: a must be a torch.Tensor, got list"
    yield "gemm b ndarray", lambda: pg.gemm(a, b.numpy()), r"gemm: b must be a torch.Tensor, got ndarray"
    yield "gemm bias list", lambda: pg.gemm(a, b, bias=[0.0] * 3), r"gemm: bias must be a torch.Tensor, got list"
    yield "quantize weight None", lambda: pg.quantize_weight(None, bits=8), \
        r"quantize_weight: weight must be a torch.Tensor, got None"
    yield "mixed x None", lambda: pg.mixed_linear(None, q, s, bits=8), r"mixed_linear: x must be a torch.Tensor, got None"
    yield "mixed qweight None", lambda: pg.mixed_linear(x, None, s, bits=8), r"mixed_linear: qweight must be a torch.Tensor"
    yield "mixed scales float", lambda: pg.mixed_linear(x, q, 0.5, bits=8), \
        r"mixed_linear: scales must be a torch.Tensor, got float"
    yield "mixed bias str", lambda: pg.mixed_linear(x, q, s, bits=8, bias="no"), r"mixed_linear: bias must be a torch.Tensor"
    yield "dequantize qweight None", lambda: pg.dequantize_weight(None, s, bits=8), \
        r"dequantize_weight: qweight must be a torch.Tensor, got None"
    yield "dequantize scales None", lambda: pg.dequantize_weight(q, None, bits=8), \
        r"dequantize_weight: scales must be a torch.Tensor, got None"


TYPES = list(type_cases())


@pytest.mark.parametrize("name,call,match", TYPES, ids=[c[0] for c in TYPES])
def test_non_tensor_argument_is_a_type_error(name, call, match):
    with pytest.raises(TypeError, match=match):
        call()


# ---- 6: QuantizedLinear's constructor -----------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"group_size": 0}, r"group_size must be None \(per channel\) or a positive int .*got 0"),
    ({"group_size": -32}, r"group_size must be None .*got -32"),
    ({"group_size": 32.0}, r"group_size must be None .*got 32.0"),
    ({"group_size": 48}, r"group_size 48 must divide in_features 64"),
    ({"bits": "4"}, r"bits must be 4 or 8, got '4'"),
    ({"bits": 3}, r"bits must be 4 or 8, got 3"),
    ({"dtype": torch.float64}, r"dtype must be torch.float32, torch.float16 or torch.bfloat16 .*got torch.float64"),
    ({"dtype": torch.int32}, r"dtype must be .*got torch.int32"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_quantized_linear_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pg.nn.QuantizedLinear(64, 8, **kwargs)


@pytest.mark.parametrize("group", [None, 32, np.int64(32)], ids=["chan", "32", "np.int64"])
def test_quantized_linear_group_sizes(group):
    m = pg.nn.QuantizedLinear(64, 8, bits=4, group_size=group, dtype=f32)
    assert m.scales.shape == ((8,) if group is None else (8, 2))
    assert m.group_size is None or type(m.group_size) is int
    lin = torch.nn.Linear(64, 8)
    q = pg.nn.QuantizedLinear.from_linear(lin, bits=4, group_size=group)
    x = rand((3, 64), f32)
    w = dequant_ref(q.qweight, q.scales, 4, None if group is None else int(group))
    torch.testing.assert_close(q(x).double(), x.double() @ w.T + lin.bias.double(), rtol=1e-4, atol=1e-4)


# ---- 11: group_size types, scales that require grad ----------------------------------------

@pytest.mark.parametrize("group", [np.int64(32), torch.tensor(32)], ids=["np.int64", "0-d tensor"])
def test_group_size_accepts_integer_likes(group):
    w, x = rand((8, 64), bf16), rand((2, 64), bf16)
    q, s = pg.quantize_weight(w, bits=4, group_size=group)
    q32, s32 = pg.quantize_weight(w, bits=4, group_size=32)
    assert torch.equal(q, q32) and torch.equal(s, s32)
    assert torch.equal(pg.mixed_linear(x, q, s, bits=4, group_size=group),
                       pg.mixed_linear(x, q, s, bits=4, group_size=32))


@pytest.mark.parametrize("group", [32.0, True, torch.tensor(32.0), "32"], ids=["float", "bool", "float tensor", "str"])
def test_group_size_refuses_non_integers(group):
    with pytest.raises(ValueError, match=r"group_size must be None \(per channel\) or a positive int"):
        pg.quantize_weight(rand((8, 64), f32), bits=8, group_size=group)


def test_scales_requiring_grad_are_refused():
    # (the result silently had no gradient path to scales)
    q, s = pg.quantize_weight(rand((8, 64), f32), bits=8)
    x = rand((2, 64), f32)
    with pytest.raises(RuntimeError, match=r"mixed_linear: scales require grad, but the quantised weight is "
                                           r"not differentiable .*pass scales.detach\(\)"):
        pg.mixed_linear(x, q, s.requires_grad_(), bits=8)
    with torch.no_grad():
        assert pg.mixed_linear(x, q, s, bits=8).shape == (2, 8)
    assert pg.mixed_linear(x, q, s.detach(), bits=8).shape == (2, 8)
    # also through torch.ops, and under vmap (whose wrappers read requires_grad False)
    ops = getattr(torch.ops, pg.info()["namespace"])
    with pytest.raises(RuntimeError, match=r"mixed_linear: scales require grad"):
        ops.mixed_linear(x, q, s, 8, 0, None, 0)
    with pytest.raises(RuntimeError, match=r"mixed_linear: scales require grad"):
        torch.vmap(lambda qi, si: pg.mixed_linear(x, qi, si, bits=8))(torch.stack([q, q]), torch.stack([s, s]))


def test_version_without_torch_or_binaries():
    # (was: importing torch and loading a binding; with a bad target an ImportError)
    proc = run_python("import sys, portable_gemm as pg\nv = pg.__version__\n"
                      "print('VERSION', v, 'torch' in sys.modules, pg._state is None)",
                      env={"PORTABLE_GEMM_TARGET": "bogus"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = _manifest(INSTALLED).get("project_version", "unknown")
    assert f"VERSION {want} False True" in proc.stdout, proc.stdout


# ---- 7, 8, 9, 10: the loader on damaged / unusual copies ----------------------------------

def test_check_library_file_turns_header_damage_into_oserror(tmp_path):
    # (was struct.error, which is not an OSError: no fallback, a raw error at import)
    good = INSTALLED / "lib" / _cpu_bindings(_manifest(INSTALLED))[_newest()]["file"]
    data = bytearray(good.read_bytes())
    data[54:56] = (0).to_bytes(2, "little")  # e_phentsize
    bad = tmp_path / good.name
    bad.write_bytes(bytes(data))
    with pytest.raises(OSError, match=r"has a damaged ELF header \(program header size 0, not 56\)"):
        check_library_file(bad)
    with pytest.raises(OSError, match=r"differs from the build manifest .*: it has a damaged ELF header"):
        check_library_file(bad, hashlib.sha256(good.read_bytes()).hexdigest())


def _newest() -> str:
    return _targets_newest_first(_manifest(INSTALLED))[0]


# Captures every warning of the import; the case's body reports them.
CATCH = ("import warnings\n_CATCH = warnings.catch_warnings(record=True)\nCAUGHT = _CATCH.__enter__()\n"
         "warnings.simplefilter('always')\n")
REPORT_WARNINGS = "report(warnings=[str(w.message) for w in CAUGHT if 'portable_gemm' in str(w.message)])\n"


def _prepare(base):
    """name -> (root, code, env): the copies are made here and their interpreters run at once."""
    m0 = _manifest(INSTALLED)
    newest = _newest()
    binding = _cpu_bindings(m0)[newest]["file"]
    cases = {}

    def new(name):
        root = base / name
        root.mkdir()
        return root, copy_package(root)

    def damage_header(pkg, consistent_manifest):
        f = pkg / "lib" / binding
        data = bytearray(f.read_bytes())
        data[54:56] = (0).to_bytes(2, "little")  # e_phentsize 0: no program header can be read
        f.write_bytes(bytes(data))
        if consistent_manifest:
            m = json.loads(json.dumps(m0))
            for b in m["binaries"]:
                if b.get("file") == binding:
                    b["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
            _write_manifest(pkg, m)

    for name, consistent in (("header_damaged", False), ("header_damaged_manifest_agrees", True)):
        root, pkg = new(name)
        damage_header(pkg, consistent)
        cases[name] = (root, script(root, REPORT_WARNINGS, before_torch=CATCH), {})

    # the manifest's binding target is not a version
    root, pkg = new("manifest_bad_target")
    m = json.loads(json.dumps(m0))
    for b in m["binaries"]:
        if b.get("target") == newest:
            b["target"] = f"{newest}abc"
    _write_manifest(pkg, m)
    cases["manifest_bad_target"] = (root, script(root), {})

    root, pkg = new("manifest_bad_minimum")
    _write_manifest(pkg, {**m0, "minimum_torch": "two.nine"})
    cases["manifest_bad_minimum"] = (root, script(root), {})

    # the kernel library's name comes from the manifest (the usual file stays: bindings link it)
    root, pkg = new("kernels_renamed")
    m = json.loads(json.dumps(m0))
    for b in m["binaries"]:
        if b.get("kind") == "kernels":
            (pkg / "lib" / "libmy_kernels.so").write_bytes((pkg / "lib" / b["file"]).read_bytes())
            b["file"] = "libmy_kernels.so"
    _write_manifest(pkg, m)
    cases["kernels_renamed"] = (root, script(root), {})

    root, pkg = new("kernels_named_but_missing")
    m = json.loads(json.dumps(m0))
    for b in m["binaries"]:
        if b.get("kind") == "kernels":
            b["file"] = "libmissing_kernels.so"
    _write_manifest(pkg, m)
    cases["kernels_named_but_missing"] = (root, script(root), {})

    for value in ("2.13abc", "2.10.5"):
        root, pkg = new(f"forced_{value}")
        cases[f"forced {value}"] = (root, script(root), {"PORTABLE_GEMM_TARGET": value})
    return cases


@pytest.fixture(scope="module")
def loader_cases(tmp_path_factory):
    prepared = _prepare(tmp_path_factory.mktemp("python_layer"))
    procs = {}
    for name, (root, code, env) in prepared.items():
        full_env = {k: v for k, v in os.environ.items() if k != "PORTABLE_GEMM_TARGET"}
        procs[name] = subprocess.Popen([sys.executable, "-c", code], cwd=root, env={**full_env, **env},
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=240)
        results[name] = (p.returncode, all_reports(out), err)
    return results


def _fallback_report(loader_cases, name):
    rc, reports, err = loader_cases[name]
    assert rc == 0, f"{name}: expected a clean fallback, exit {rc}\n{err[-3000:]}"
    first, last = reports[0], reports[-1]
    assert first["ok"] and first["gemm"], first
    return first, last


@pytest.mark.parametrize("name,reason", [
    ("header_damaged", r"differs from the build manifest \(sha256 .*\): it has a damaged ELF header"),
    ("header_damaged_manifest_agrees", r"has a damaged ELF header \(program header size 0, not 56\)"),
])
def test_damaged_header_falls_back_and_says_why(loader_cases, name, reason):
    import re

    ts = _targets_newest_first(_manifest(INSTALLED))
    if len(ts) < 2:
        pytest.skip(f"needs two targets that run on torch {torch.__version__} to fall back")
    rep, warned = _fallback_report(loader_cases, name)
    newest, second = ts[0], ts[1]
    status, why = rep["candidates"][newest]
    assert status == "rejected" and why.startswith("failed to load: ") and re.search(reason, why), why
    # item 8: the loaded target names the fallback, not the stale "but <newest> is newer"
    status, why = rep["candidates"][second]
    assert rep["target"] == second and status == "loaded", rep["candidates"]
    assert why.startswith(f"fallback: {newest} failed to load (") and re.search(reason, why), why
    for t in ts[2:]:
        assert rep["candidates"][t] == ["eligible", f"runs on torch {torch.__version__}, but {second} was loaded"]
    assert len(warned["warnings"]) == 1, warned
    msg = warned["warnings"][0]
    assert f"{newest} failed to load (" in msg and re.search(reason, msg) and f"loaded target {second} instead" in msg


@pytest.mark.parametrize("name,needles", [
    ("manifest_bad_target", ["holds a version that cannot be read", "abc' is not a target version", "reinstall the wheel"]),
    ("manifest_bad_minimum", ["holds a version that cannot be read", "'two.nine'", "reinstall the wheel"]),
    ("kernels_named_but_missing", ["the kernel library cannot be used: libmissing_kernels.so is missing",
                                   "reinstall the wheel"]),
    ("forced 2.13abc", ["PORTABLE_GEMM_TARGET='2.13abc' is not a version like '2.10'"]),
    ("forced 2.10.5", ["PORTABLE_GEMM_TARGET='2.10.5' is not a version like '2.10'"]),
])
def test_loader_import_errors(loader_cases, name, needles):
    rc, reports, err = loader_cases[name]
    assert rc == 1 and reports and reports[0]["ok"] is False, f"{name}: exit {rc}\n{err[-3000:]}"
    for n in needles:
        assert n in reports[0]["error"], (n, reports[0]["error"])
    assert all(v == [False, False] for v in reports[0]["state"].values()), reports[0]["state"]


def test_kernel_library_name_from_manifest(loader_cases):
    rc, reports, err = loader_cases["kernels_renamed"]
    assert rc == 0, err[-3000:]
    rep = reports[0]
    assert rep["ok"] and rep["gemm"] and rep["target"] == _newest(), rep
    assert rep["libraries"]["kernels"].endswith(os.sep + "libmy_kernels.so"), rep["libraries"]


def test_source_commit_from_manifest():
    from portable_gemm._info import source_commit

    assert source_commit({}) is None
    assert source_commit({"source": None}) is None
    assert source_commit({"source": {"commit": "9ede825", "dirty": False}}) == "9ede825"
    assert source_commit({"source": {"commit": "9ede825", "dirty": True}}) == "9ede825-dirty"


def test_installed_manifest_records_its_source():
    # The wheel says which commit built it (bench results quote it); a CI run builds the
    # wheel from the very checkout it tests, so there the commit is this checkout's HEAD.
    manifest = pg.info()["manifest"]
    assert "source" in manifest, sorted(manifest)
    src = manifest["source"]
    if src is None:
        assert not (REPO / ".git").exists() or os.environ.get("CI") != "true", "a CI build from git recorded no commit"
        pytest.skip("this wheel records no source commit (not built from a git checkout): nothing to compare")
    assert set(src) == {"commit", "dirty"} and isinstance(src["dirty"], bool), src
    assert len(src["commit"]) >= 7 and all(c in "0123456789abcdef" for c in src["commit"]), src
    if os.environ.get("CI") == "true" and (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        assert head.stdout.startswith(src["commit"]) and not src["dirty"], (src, head.stdout)
    from portable_gemm._info import format_info, source_commit

    assert f"source       {source_commit(manifest)}" in format_info(pg.info()).splitlines()


# ---- the PORTABLE_GEMM_* settings (portable_gemm._env: pure, no binaries) ------------------

@pytest.mark.parametrize("env, target, expect", [
    ({}, "2.9", []),
    ({}, None, []),
    ({"PORTABLE_GEMM_ISA": "avx2", "PORTABLE_GEMM_NUM_THREADS": " +4", "PORTABLE_GEMM_HUGE_PAGES": "1"}, "2.9", []),
    ({"PORTABLE_GEMM_ISA": "", "PORTABLE_GEMM_NUM_THREADS": "", "PORTABLE_GEMM_POOL": ""}, "2.13", []),
    ({"PORTABLE_GEMM_ISA": "sse"}, None, ["PORTABLE_GEMM_ISA='sse' is not one of"]),
    ({"PORTABLE_GEMM_NUM_THREADS": "4x"}, "2.9", ["PORTABLE_GEMM_NUM_THREADS='4x' is not a whole number >= 1"]),
    ({"PORTABLE_GEMM_NUM_THREADS": "-3"}, None, ["PORTABLE_GEMM_NUM_THREADS='-3' is not a whole number >= 1"]),
    ({"PORTABLE_GEMM_NUM_THREADS": "8"}, None, []),  # the DLPack door's own pool reads it
    ({"PORTABLE_GEMM_NUM_THREADS": "8"}, "2.11", ["sizes the library's own pool, which target 2.11's torch ops"]),
    ({"PORTABLE_GEMM_POOL": "own"}, "2.9", []),
    ({"PORTABLE_GEMM_POOL": "openmp"}, "2.12", ["PORTABLE_GEMM_POOL='openmp' applies to target 2.9 only"]),
    ({"PORTABLE_GEMM_POOL": "x"}, "2.9", ["PORTABLE_GEMM_POOL='x' is neither 'own' nor 'openmp'"]),
    ({"PORTABLE_GEMM_POOL": "x"}, None, []),  # the door has no torch ops to put on a pool
    ({"PORTABLE_GEMM_HUGE_PAGES": "no"}, "2.10", ["PORTABLE_GEMM_HUGE_PAGES='no' is neither '0' (off) nor '1'"]),
    ({"PORTABLE_GEMM_AVX2_DQ": ""}, "2.13", []),
    ({"PORTABLE_GEMM_AVX2_DQ": "0"}, "2.13", ["PORTABLE_GEMM_AVX2_DQ='0' applies to the AVX2 kernels only; the CPU "
                                             "kernels run on avx512"]),
    ({"PORTABLE_GEMM_AVX2_DQ": "1", "PORTABLE_GEMM_ISA": ""}, None, ["PORTABLE_GEMM_AVX2_DQ='1' applies to the AVX2"]),
    ({"PORTABLE_GEMM_AVX2_DQ": "on"}, "2.9", ["PORTABLE_GEMM_AVX2_DQ='on' is neither '0' (never) nor '1'"]),
    ({"PORTABLE_GEMM_AVX2_DQ": "yes"}, None, ["PORTABLE_GEMM_AVX2_DQ='yes' is neither"]),
    ({"PORTABLE_GEMM_DISABLE_SM90": "1"}, "2.11", []),
    ({"PORTABLE_GEMM_DISABLE_SM90": "0"}, None, []),
    ({"PORTABLE_GEMM_DISABLE_SM90": "false"}, "2.11", ["PORTABLE_GEMM_DISABLE_SM90='false' is neither '0' nor '1'; "
                                                      "the CUDA kernels read it as '1': the sm_90 kernels are off"]),
    ({"PORTABLE_GEMM_DISABLE_SM90": "00"}, None, ["PORTABLE_GEMM_DISABLE_SM90='00' is neither '0' nor '1'; the "
                                                  "CUDA kernels read it as '0': the sm_90 kernels are on"]),
    ({"PORTABLE_GEMM_ISA": "x", "PORTABLE_GEMM_POOL": "own", "PORTABLE_GEMM_NUM_THREADS": "0"}, "2.10",
     ["PORTABLE_GEMM_ISA='x'", "PORTABLE_GEMM_NUM_THREADS='0' is not", "PORTABLE_GEMM_POOL='own' applies"]),
])
def test_env_problems(env, target, expect):
    from portable_gemm import _env

    threading = None if target is None else _env.TORCH_POOL if target != "2.9" else "torch_openmp"
    got = _env.problems(env, cpu_isa="avx512", target=target, threading=threading, threading_why="w")
    assert len(got) == len(expect) and all(e in g for e, g in zip(expect, got)), got


@pytest.mark.parametrize("value, off", [(None, False), ("", False), ("0", False), ("1", True), ("false", True),
                                        ("0x1", False)])
def test_info_says_when_the_sm90_kernels_are_switched_off(value, off):
    # info's "sm_90 gemm" line comes from the build manifest; the kernels read the variable
    # as sm90_dispatch.cu does (set and not starting with 0: off)
    from portable_gemm import _env
    from portable_gemm._info import format_info

    env = {} if value is None else {"PORTABLE_GEMM_DISABLE_SM90": value}
    assert _env.sm90_disabled(env) is off
    d = pg.info()
    if not d["manifest"].get("toolchain", {}).get("cuda"):
        pytest.skip("this wheel was built without CUDA: info has no sm_90 line")
    saved = os.environ.pop("PORTABLE_GEMM_DISABLE_SM90", None)
    try:
        os.environ.update(env)
        line = next(ln for ln in format_info(d).splitlines() if ln.startswith("sm_90 gemm"))
    finally:
        os.environ.pop("PORTABLE_GEMM_DISABLE_SM90", None)
        if saved is not None:
            os.environ["PORTABLE_GEMM_DISABLE_SM90"] = saved
    assert line.endswith(f" (off: PORTABLE_GEMM_DISABLE_SM90={value})") is off, line


# PORTABLE_GEMM_AVX2_DQ where the AVX2 kernels run (an AVX2-only CPU, or PORTABLE_GEMM_ISA=avx2):
# '0' and '1' do something there; other values are still refused.
@pytest.mark.parametrize("value, expect", [("0", None), ("1", None), ("", None), ("on", "is neither '0' (never)")])
def test_env_problems_avx2_dq_on_avx2(value, expect):
    from portable_gemm import _env

    got = _env.problems({"PORTABLE_GEMM_AVX2_DQ": value}, cpu_isa="avx2", target="2.13",
                        threading=_env.TORCH_POOL, threading_why="w")
    assert (got == []) if expect is None else (len(got) == 1 and expect in got[0]), got


@pytest.mark.parametrize("value, threads", [("4", 4), (" +4", 4), ("1", 1), ("0", None), ("-1", None),
                                            ("4x", None), ("", None), (None, None), ("2.5", None)])
def test_pool_threads_rule(value, threads):
    from portable_gemm import _env

    assert _env.pool_threads(value) == threads


def test_quantized_linear_in_float64_is_refused_clearly():
    m = pg.nn.QuantizedLinear(64, 8, bits=8, group_size=None).double()
    with pytest.raises(TypeError, match=r"scales are torch.float64 .* convert the module with .float\(\)"):
        m(torch.randn(2, 64, dtype=torch.float64))


def test_an_unreadable_torch_version_is_named_as_such():
    # select_variant refuses the torch version and the manifest's alike; the loader tells
    # the user which (it had blamed the manifest and said to reinstall the wheel)
    r = run_python("import torch\ntorch.__version__ = 'unknown'\nimport portable_gemm")
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: portable_gemm: cannot read the installed torch's version (cannot read a "
                           "major.minor version from 'unknown')"), last
    assert "manifest" not in last, last

"""Vendoring without rebuilding: a copy under another namespace lives beside the real package."""

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_close, dequant_ref, run_python

import portable_gemm as pg
from portable_gemm._vendor import KERNELS, dynamic_strings, kernels_name, vendor

PKG = Path(pg.__file__).resolve().parent


@pytest.fixture(scope="module")
def vendored(tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    vendor(root / "pg_copy", "downstream_ns")
    return root


def test_real_and_vendored_in_one_process(vendored):
    code = f"""
import importlib, sys, torch
sys.path.insert(0, {str(vendored)!r})
import portable_gemm as pg
import pg_copy
a, b = torch.randn(9, 40), torch.randn(40, 7)
r1 = pg.gemm(a, b, activation="relu")
r2 = pg_copy.gemm(a, b, activation="relu")
assert torch.equal(r1, r2)
assert torch.equal(torch.ops.downstream_ns.gemm(a, b, None, 1), r1)
assert pg_copy.info()["namespace"] == "downstream_ns" and pg.info()["namespace"] == "portable_gemm"
assert pg_copy.info()["libraries"]["cpu"].startswith({str(vendored)!r})
w = torch.randn(16, 64)
q, s = pg_copy.quantize_weight(w, bits=4, group_size=32)
x = torch.randn(3, 64)
assert torch.equal(pg_copy.mixed_linear(x, q, s, bits=4, group_size=32),
                   pg.mixed_linear(x, q, s, bits=4, group_size=32))
importlib.reload(pg_copy)          # importing the same copy again is harmless
assert torch.equal(pg_copy.gemm(a, b, activation="relu"), r1)
# each package runs its own kernel library: both are mapped, each from its own folder
maps = open("/proc/self/maps").read()
assert {str(PKG / "lib" / KERNELS)!r} in maps, "the original kernel library is not loaded"
assert {str((vendored / "pg_copy" / "lib").resolve())!r} + "/libpgk" in maps, "the copy's kernel library is not loaded"
print("OK")
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")


def test_vendored_copy_cli_is_its_own(vendored):
    """`python -m pg_copy ...` describes and runs the copy, even where portable_gemm itself
    cannot be imported (a blocked import stands in for an uninstalled original)."""
    run = ("import runpy, sys\n"
           "sys.modules['portable_gemm'] = None  # any import of the original now fails\n"
           f"sys.path.insert(0, {str(vendored)!r})\n"
           "sys.argv = ['pg_copy'] + sys.argv[1:]\n"
           "runpy.run_module('pg_copy', run_name='__main__', alter_sys=True)\n")
    proc = run_python("", args=["-c", run, "info"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("portable_gemm ") and "(torch.ops.downstream_ns; a vendored copy)" in proc.stdout
    assert f"cpu      {vendored.resolve() / 'pg_copy' / 'lib'}" in proc.stdout, proc.stdout
    proc = run_python("", args=["-c", run, "demo", "--device", "cpu"])
    assert proc.returncode == 0 and "5 passed, 0 failed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = run_python("", args=["-c", run, "--cmake-dir"])
    assert proc.returncode == 2 and "a vendored copy carries none" in proc.stderr, proc.stderr[-2000:]
    proc = run_python("", args=["-c", run, "vendor", "--into", str(vendored / "again"), "--namespace", "ns9"])
    assert proc.returncode == 2 and "pg_copy is a vendored copy" in proc.stderr, proc.stderr[-2000:]
    assert not (vendored / "again").exists()


def _readelf_dynamic(path: Path) -> dict[str, list[str]]:
    """NEEDED / SONAME entries as binutils' readelf prints them (independent of our parser)."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    found: dict[str, list[str]] = {"NEEDED": [], "SONAME": []}
    for tag, name in re.findall(r"\((NEEDED|SONAME)\)\s+\S+.*?\[(.+?)\]", out):
        found[tag].append(name)
    return found


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf not installed")
def test_copy_has_its_own_kernel_library(vendored):
    """The dynamic linker matches DT_NEEDED against loaded SONAMEs: with one shared name, the
    copy's bindings would bind to the original's kernel library (or another copy's)."""
    lib = vendored / "pg_copy" / "lib"
    manifest = json.loads((lib / "manifest.json").read_text())
    original = json.loads((PKG / "lib" / "manifest.json").read_text())
    kernels_sha = next(b["sha256"] for b in original["binaries"] if b["kind"] == "kernels")
    new = next(b["file"] for b in manifest["binaries"] if b["kind"] == "kernels")
    assert new == kernels_name("downstream_ns", kernels_sha) and new != KERNELS
    assert len(new) == len(KERNELS) and new != kernels_name("other_ns", kernels_sha)
    assert manifest["vendored"] == {"namespace": "downstream_ns", "kernels_renamed_from": KERNELS}
    assert not (lib / KERNELS).exists()
    assert _readelf_dynamic(lib / new)["SONAME"] == [new]
    assert [(t, s) for t, s, _ in dynamic_strings(lib / new) if t == 14] == [(14, new)]
    users = [lib / b["file"] for b in manifest["binaries"] if b["kind"] == "binding"]
    users += list((vendored / "pg_copy").glob("_dlpack*.so"))
    assert len(users) >= 6, users  # 5 CPU bindings (+ CUDA ones) and the DLPack module
    for path in users:
        needed = _readelf_dynamic(path)["NEEDED"]
        assert new in needed and KERNELS not in needed, (path.name, needed)
    for b in manifest["binaries"]:  # the rewritten files are what the manifest says
        assert hashlib.sha256((lib / b["file"]).read_bytes()).hexdigest() == b["sha256"], b["file"]
    # the original package is untouched
    assert _readelf_dynamic(PKG / "lib" / KERNELS)["SONAME"] == [KERNELS]


def test_copy_dlpack_door_uses_its_own_kernels(vendored):
    code = f"""
import sys, numpy as np
sys.path.insert(0, {str(vendored)!r})
import pg_copy.dlpack as d
a, b = np.random.rand(5, 12).astype(np.float32), np.random.rand(12, 3).astype(np.float32)
out = d.gemm(a, b)
err = np.abs(out.astype(np.float64) - a.astype(np.float64) @ b.astype(np.float64)).max()
assert err < 1e-5, err
maps = open("/proc/self/maps").read()
assert {str((vendored / "pg_copy" / "lib").resolve())!r} + "/libpgk" in maps
assert "{KERNELS}" not in maps, "the copy's DLPack door loaded the original kernel library"
assert "torch" not in sys.modules
print("OK")
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")


def test_force_replaces_only_a_vendored_copy(tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="not a vendored copy"):
        vendor(dest, "ns_force", force=True)
    assert (dest / "keep.txt").read_text() == "user data"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        vendor(afile, "ns_force", force=True)
    assert afile.read_text() == "x"
    with pytest.raises(ValueError, match="this package's own"):
        vendor(tmp_path / "same_ns", "portable_gemm")
    before = sorted(p.name for p in PKG.iterdir())
    for into in (PKG, PKG / "lib" / "nested"):  # the installed package itself is never replaced
        with pytest.raises(ValueError, match="inside this installed package"):
            vendor(into, "ns_force", force=True)
    assert sorted(p.name for p in PKG.iterdir()) == before
    copy = tmp_path / "copy_ok"
    vendor(copy, "ns_force")
    (copy / "stale.txt").write_text("from the earlier copy")
    vendor(copy, "ns_force2", force=True)
    assert "NAMESPACE = 'ns_force2'" in (copy / "_namespace.py").read_text()
    assert not (copy / "stale.txt").exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temporary folders left behind: {leftovers}"


def test_vendor_cli_and_refusals(tmp_path):
    proc = run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(tmp_path / 'x')!r}, '--namespace', 'aten']))")
    assert proc.returncode == 2 and "belongs to torch" in proc.stderr
    proc = run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(tmp_path / 'bad-name')!r}, '--namespace', 'ns1']))")
    assert proc.returncode == 2 and "not importable" in proc.stderr
    dest = tmp_path / "ok_copy"
    assert run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(dest)!r}, '--namespace', 'ns1']))").returncode == 0
    assert (dest / "lib" / "manifest.json").is_file()
    assert "NAMESPACE = 'ns1'" in (dest / "_namespace.py").read_text()
    proc = run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(dest)!r}, '--namespace', 'ns1']))")
    assert proc.returncode == 2 and "exists" in proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folder left behind"


def test_example_downstream_package(tmp_path):
    import shutil
    ex = tmp_path / "downstream_py"
    shutil.copytree(REPO / "examples" / "downstream_py", ex)
    vendor(ex / "mylib" / "_gemm", "mylib_gemm")
    script = (ex / "use_both.py").read_text()
    proc = run_python(script.replace("__file__", repr(str(ex / "use_both.py"))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "agree bit for bit" in proc.stdout


def test_quantized_linear_module():
    lin = torch.nn.Linear(256, 96).to(torch.bfloat16)
    m = pg.nn.QuantizedLinear.from_linear(lin, bits=4, group_size=128)
    assert "bits=4, group_size=128" in repr(m)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    w = dequant_ref(m.qweight, m.scales, 4, 128)  # float64, independent of the package
    ref = x.double() @ w.T + lin.bias.double()
    out = m(x)
    assert_close(out, ref, torch.bfloat16)
    m2 = pg.nn.QuantizedLinear(256, 96, bits=4, group_size=128)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2(x), out)
    assert m2.to("cpu").qweight.device.type == "cpu"
    with pytest.raises(ValueError, match="must divide in_features"):
        pg.nn.QuantizedLinear(100, 8, group_size=128)

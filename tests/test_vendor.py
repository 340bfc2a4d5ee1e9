"""Vendoring without rebuilding: a copy under another namespace lives beside the real package."""

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_close, dequant_ref, run_python, tree_license_files

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
# errors name the op as the namespace it was called through (the copy's C++ and Python alike)
for fn, name in ((pg_copy.gemm, "downstream_ns.gemm"), (pg.gemm, "portable_gemm.gemm"),
                 (lambda a, b: torch.ops.downstream_ns.gemm(a, b, None, 0), "downstream_ns.gemm"),
                 (lambda a, b: torch.ops.portable_gemm.gemm(a, b, None, 0), "portable_gemm.gemm")):
    try:
        fn(torch.randn(3, 4), torch.randn(5, 6))
        raise AssertionError("no error")
    except RuntimeError as e:
        assert str(e).startswith(name + ": "), (name, str(e))
try:
    pg_copy.gemm(torch.randn(3, 4), "b")
    raise AssertionError("no error")
except TypeError as e:
    assert str(e).startswith("downstream_ns.gemm: b must be a torch.Tensor"), str(e)
# the copy's autocast rule is registered under its namespace too
with torch.autocast("cpu", dtype=torch.bfloat16):
    assert torch.ops.downstream_ns.gemm(a, b, None, 1).dtype == torch.bfloat16
    assert torch.equal(pg_copy.gemm(a, b), pg.gemm(a, b))
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
    assert proc.returncode == 0 and "7 passed, 0 failed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
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


def test_copy_carries_the_licenses(vendored):
    """A downstream wheel that ships the copy ships its notices: the package's licenses/
    folder (LICENSE, NOTICE and the compiled-in projects' licences) travels with it."""
    expected = tree_license_files()
    for root in (PKG, vendored / "pg_copy"):
        folder = root / "licenses"
        got = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        assert got == expected, (root, sorted(got))


def test_copy_dlpack_door_uses_its_own_kernels(vendored):
    code = f"""
import sys, numpy as np
sys.path.insert(0, {str(vendored)!r})
import pg_copy.dlpack as d
a, b = np.random.rand(5, 12).astype(np.float32), np.random.rand(12, 3).astype(np.float32)
out = d.gemm(a, b)
err = np.abs(out.astype(np.float64) - a.astype(np.float64) @ b.astype(np.float64)).max()
assert err < 1e-5, err
try:
    d.gemm(a, a)
    raise AssertionError("no error")
except ValueError as e:  # the copy's errors name the copy
    assert str(e).startswith("pg_copy.dlpack.gemm: "), str(e)
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
    proc = run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(dest)!r}, '--namespace', 'ns1']))")
    assert proc.returncode == 0, proc.stderr
    # The package data it tells the user to ship is the list the example ships (and tests).
    example = (REPO / "examples" / "downstream_py" / "pyproject.toml").read_text()
    patterns = re.findall(r'"([^"]+)"', re.search(r'^"mylib\._gemm" = \[(.*)\]$', example, re.M).group(1))
    assert len(patterns) >= 5, patterns
    hint = next(line for line in proc.stdout.splitlines() if line.startswith("to ship it in your wheel"))
    for pattern in patterns:
        assert f"ok_copy/{pattern}" in hint, (pattern, hint)
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
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 activations run as bf16
        assert torch.equal(m(x.float()), out)
    m2 = pg.nn.QuantizedLinear(256, 96, bits=4, group_size=128)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2(x), out)
    assert m2.to("cpu").qweight.device.type == "cpu"
    with pytest.raises(ValueError, match="must divide in_features"):
        pg.nn.QuantizedLinear(100, 8, group_size=128)


def test_copy_has_the_mode_of_a_plain_folder(tmp_path):
    """mkdtemp makes its folder 0700; the copy must not keep that, or another user (a
    container's non-root USER, a shared checkout) sees an empty namespace package."""
    umask = os.umask(0o022)
    try:
        dest = vendor(tmp_path / "modes", "ns_modes")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "lib").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "lib" / "manifest.json").stat().st_mode) & 0o044 == 0o044


def test_stale_work_folders_of_killed_runs_are_removed(tmp_path):
    """A run killed by SIGKILL leaves its work folder; the next run for the same copy removes
    those whose process is gone, and leaves a live process's alone."""
    dead = tmp_path / ".dest.vendoring-999999999-abc123"  # above any pid_max: no such process
    live = tmp_path / f".dest.vendoring-{os.getpid()}-def456"
    other = tmp_path / ".unrelated"
    for d in (dead, live, other):
        (d / "lib").mkdir(parents=True)
    vendor(tmp_path / "dest", "ns_stale")
    assert not dead.exists() and live.is_dir() and other.is_dir()
    # and a real kill: the work folder it leaves has that name, so the next run finds it
    proc = subprocess.Popen([sys.executable, "-c", "import portable_gemm._vendor as v, shutil, time\n"
                             "orig = shutil.copytree\n"
                             "def slow(*a, **k):\n    r = orig(*a, **k); time.sleep(60); return r\n"
                             "shutil.copytree = slow\n"
                             f"v.vendor({str(tmp_path / 'killed')!r}, 'ns_killed')"])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f".killed.vendoring-{proc.pid}-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    left = list(tmp_path.glob(f".killed.vendoring-{proc.pid}-*"))
    assert left, "the killed run left no work folder (or named it otherwise)"
    vendor(tmp_path / "killed", "ns_killed")
    assert not any(p.exists() for p in left), left
    assert (tmp_path / "killed" / "lib" / "manifest.json").is_file()


@pytest.mark.parametrize("ns,why", [
    ("higher_order", "an attribute of torch.ops"), ("load_library", "an attribute of torch.ops"),
    ("c10d", "already registered in torch"), ("ünï", "ASCII Python identifier"),
])
def test_namespaces_torch_uses_are_refused(tmp_path, ns, why):
    if ns == "c10d" and not any(n.startswith("c10d::") for n in torch._C._dispatch_get_all_op_names()):
        pytest.skip("this torch (built without distributed) registers no c10d ops")
    with pytest.raises(ValueError, match=why):
        vendor(tmp_path / "ns_copy", ns)
    assert not (tmp_path / "ns_copy").exists()


def test_top_level_copy_may_not_hide_a_module(tmp_path):
    for name in ("portable_gemm", "json"):
        with pytest.raises(ValueError, match="hide"):
            vendor(tmp_path / name, "ns_hide")
        assert not (tmp_path / name).exists()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    vendor(tmp_path / "pkg" / "json", "ns_hide")  # pkg.json hides nothing
    assert (tmp_path / "pkg" / "json" / "lib" / "manifest.json").is_file()


def test_vendor_cli_reports_os_errors_and_import_hints(tmp_path):
    main = "from portable_gemm.__main__ import main; import sys; sys.exit(main({}))"
    proc = run_python(main.format(['vendor', '--into', '/proc/no_such_dir/_g', '--namespace', 'ns_os']))
    assert proc.returncode == 2 and proc.stderr.startswith("vendor: ") and "Traceback" not in proc.stderr, proc.stderr
    proc = run_python(main.format(['vendor', '--into', str(tmp_path / "mylib" / "_g"), '--namespace', 'ns_hint']))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"or add {tmp_path / 'mylib' / '__init__.py'} to import it as mylib._g" in proc.stdout, proc.stdout
    assert "package data _g/*.so, _g/lib/*.so, _g/lib/manifest.json, _g/licenses/* and _g/licenses/LICENSES/*" \
        in proc.stdout, proc.stdout


def test_two_copies_under_one_namespace(tmp_path):
    """Two packages that vendored under the same namespace: the second import fails at once,
    naming the package that holds the namespace, without dlopening its older targets."""
    for pkg in ("first_pkg", "second_pkg"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        vendor(tmp_path / pkg / "_g", "shared_ns")
    code = f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
import first_pkg._g as one
try:
    import second_pkg._g
    print("SECOND IMPORTED")
except ImportError as e:
    print("ERROR", e)
files = {{line.split()[-1] for line in open("/proc/self/maps") if "second_pkg/_g/lib/portable_gemm_cpu_t" in line}}
print("MAPPED", len(files))
print("FIRST", bool(torch.equal(one.gemm(torch.ones(2, 3), torch.ones(3, 4)), torch.full((2, 4), 3.0))))
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert ("ERROR second_pkg._g (portable_gemm vendored as torch.ops.shared_ns): torch.ops.shared_ns is already "
            "defined in this process, by the package first_pkg._g") in out, out
    assert f"--into {tmp_path / 'second_pkg' / '_g'} --namespace OTHER_NAME --force" in out, out
    assert "MAPPED 1\n" in out, out  # the newest target's binding only, not all five
    assert "FIRST True" in out, out


def test_copy_names_itself_in_warnings_and_errors(tmp_path):
    (tmp_path / "wpkg").mkdir()
    (tmp_path / "wpkg" / "__init__.py").write_text("")
    dest = vendor(tmp_path / "wpkg" / "_g", "ns_warn")
    manifest = json.loads((dest / "lib" / "manifest.json").read_text())
    cpu = {b["target"]: b for b in manifest["binaries"] if b.get("kind") == "binding" and b["device"] == "cpu"}
    # the binding this torch loads (not the newest built: torch 2.11 never tries target 2.13's)
    loaded = pg.info()["target"]
    if loaded == min(cpu, key=lambda t: tuple(map(int, t.split(".")))):
        pytest.skip(f"torch {torch.__version__} loads the oldest target, {loaded}: nothing to fall back to")
    (dest / "lib" / cpu[loaded]["file"]).write_bytes(b"damaged")
    code = f"""
import sys, warnings, torch
warnings.simplefilter("always")
sys.path.insert(0, {str(tmp_path)!r})
import wpkg._g as g
print("TARGET", g.info()["target"])
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wpkg._g (portable_gemm vendored as torch.ops.ns_warn): " in proc.stderr, proc.stderr[-2000:]
    assert f"re-vendor the copy (python -m portable_gemm vendor --into {dest} --namespace ns_warn --force)" \
        in proc.stderr, proc.stderr[-2000:]
    assert "pip install --force-reinstall" not in proc.stderr


def test_copy_door_under_another_python_says_why(tmp_path):
    """A copy made under one Python holds that Python's DLPack module; imported under another,
    its door says so (simulated: the module renamed to a tag no Python takes)."""
    dest = vendor(tmp_path / "door_copy", "ns_door")
    door = next(dest.glob("_dlpack*.so"))
    door.rename(dest / "_dlpack.cpython-399-x86_64-linux-gnu.so")
    proc = run_python(f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import door_copy.dlpack")
    assert proc.returncode != 0
    assert ("the DLPack door here is _dlpack.cpython-399-x86_64-linux-gnu.so, which cpython "
            f"{sys.version_info.major}.{sys.version_info.minor} cannot import") in proc.stderr, proc.stderr[-2000:]
    assert "the torch ops work on any Python" in proc.stderr


def test_example_downstream_wheel_ships_the_copy(tmp_path):
    """The README's recipe (examples/downstream_py/pyproject.toml + setup.py): mylib's wheel
    carries every binary and the manifest, is a platform wheel, and works once installed."""
    pytest.importorskip("setuptools", reason="pip wheel --no-build-isolation needs setuptools in this venv")
    ex = tmp_path / "downstream_py"
    shutil.copytree(REPO / "examples" / "downstream_py", ex, ignore=shutil.ignore_patterns("_gemm", "build"))
    vendor(ex / "mylib" / "_gemm", "mylib_gemm")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "out"), str(ex)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whl, = (tmp_path / "out").glob("mylib-*.whl")
    assert not whl.name.endswith("-none-any.whl"), whl.name
    import zipfile
    names = set(zipfile.ZipFile(whl).namelist())
    copied = {f"mylib/_gemm/{p.relative_to(ex / 'mylib' / '_gemm')}" for p in (ex / "mylib" / "_gemm").rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    assert copied <= names, sorted(copied - names)
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(whl)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = f"""
import sys, torch
sys.path.insert(0, {str(site)!r})
import mylib
x, w, b = torch.randn(5, 64), torch.randn(64, 24), torch.randn(24)
z = x.double() @ w.double() + b.double()
ref = z * torch.sigmoid(z)
print("ERR", float((mylib.fused_linear(x, w, b).double() - ref).abs().max() / ref.abs().max()))
print("LIB", mylib._gemm.info()["libraries"]["cpu"])
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(re.search(r"ERR (\S+)", proc.stdout).group(1)) < 1e-5, proc.stdout
    assert re.search(r"LIB (\S+)", proc.stdout).group(1).startswith(str(site)), proc.stdout

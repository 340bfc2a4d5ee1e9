"""Broken installations fail cleanly: every case runs in a fresh interpreter on a private COPY
of the installed package (the installed one is never touched).

Each damaged install must end in one of two ways, never in a signal or a half-registered
torch.ops namespace:
  * a clean fallback: the broken target is 'rejected' in info() with the reason, an older
    target is 'loaded', and the ops compute the right result;
  * an ImportError whose message says what is wrong and what to do; the interpreter exits
    with status 1 and torch.ops.<namespace> has no schema and no kernel left behind.

Decisions recorded here (the loader's contract):
  * the manifest is the list of binaries; each binding must pass an ELF extent check and
    its sha256 from the manifest BEFORE dlopen, then dlopen (RTLD_NOW), then report the
    target it was built for. dlopen alone is not enough: a binding truncated inside its
    segments kills the process with SIGBUS in the dynamic loader
    (test_binding_truncated_falls_back). `vendor` refuses a sha256 mismatch too.
  * the later checks are reached with a manifest that lies consistently (the sha256 of the
    file it names): a foreign ELF ("no entry points") and a binding of another target.
  * a forced target (PORTABLE_GEMM_TARGET) never falls back.
  * CUDA bindings are never opened under a CPU-only torch.

The copies are prepared by a module-scoped fixture and their subprocesses run
PG_FAULTS_PARALLEL (default: cores, 2..4) at a time, so the file stays fast; each test
checks its case.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import TOL

INSTALLED = Path(next(iter(importlib.util.find_spec("portable_gemm").submodule_search_locations)))
TIMEOUT = 240


def _manifest(pkg: Path) -> dict:
    return json.loads((pkg / "lib" / "manifest.json").read_text())


def _cpu_bindings(manifest: dict) -> dict[str, dict]:
    return {b["target"]: b for b in manifest["binaries"] if b.get("kind") == "binding" and b.get("device") == "cpu"}


def _targets_newest_first(manifest: dict) -> list[str]:
    """The targets the loader may pick under the running torch (target <= torch), newest
    first: the order in which it tries them. Other targets are rejected by version before
    any file is looked at, so damaging them proves nothing."""
    import torch

    runtime = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    key = lambda t: tuple(int(x) for x in t.split("."))  # noqa: E731
    return sorted((t for t in _cpu_bindings(manifest) if key(t) <= runtime), key=key, reverse=True)


def copy_package(root: Path, name: str = "portable_gemm") -> Path:
    dest = root / name
    shutil.copytree(INSTALLED, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


# Prelude of every subprocess: import the copy (first on sys.path), then report what was
# registered. `state()` says, for every op, whether its schema exists and whether a CPU
# kernel is registered: after a failed import both must be False.
PRELUDE = r"""
import json, os, sys
ROOT = {root!r}
sys.path.insert(0, ROOT)
NS = {ns!r}
{before_torch}
import torch
{after_torch}

def state():
    out = {{}}
    for op in ("gemm", "quantize_weight", "mixed_linear"):
        name = NS + "::" + op
        try:
            torch._C._dispatch_find_schema_or_throw(name, "")
            schema = True
        except RuntimeError:
            schema = False
        try:
            kernel = bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"))
        except RuntimeError:
            kernel = False
        out[op] = [schema, kernel]
    return out

def report(**kw):
    print("@@" + json.dumps(kw), flush=True)

# out == a @ b against a float64 reference: no NaN, relative Frobenius error within the
# float32 tolerance (conftest.TOL) and every element within rtol = atol = 1e-5.
def gemm_ok(out, a, b):
    ref = a.double() @ b.double()
    o = out.double()
    return bool(out.shape == ref.shape and not torch.isnan(o).any()
                and (o - ref).norm() <= {tol32!r} * ref.norm()
                and torch.allclose(o, ref, rtol=1e-5, atol=1e-5))

try:
    import {modname} as pg
except ImportError as e:
    report(ok=False, error=str(e), state=state(), file=None)
    raise
assert pg.__file__.startswith(ROOT), (pg.__file__, ROOT)
a = torch.randn(5, 7); b = torch.randn(7, 3)
ok_gemm = gemm_ok(pg.gemm(a, b), a, b)
i = pg.info()
report(ok=True, target=i["target"], candidates={{c["target"]: [c["status"], c["reason"]] for c in i["candidates"]}},
       cuda=i["cuda"], gemm=ok_gemm, state=state(), file=pg.__file__, libraries=i["libraries"])
"""


def script(root: Path, body: str = "", *, ns: str = "portable_gemm", modname: str = "portable_gemm",
           before_torch: str = "", after_torch: str = "") -> str:
    return PRELUDE.format(root=str(root), ns=ns, modname=modname, before_torch=before_torch,
                          after_torch=after_torch, tol32=TOL[torch.float32]) + body


PARALLEL = int(os.environ.get("PG_FAULTS_PARALLEL", "0")) or max(2, min(4, os.cpu_count() or 2))
_POOL: ThreadPoolExecutor | None = None


class Case:
    """A prepared copy + script, queued at once on a pool of PARALLEL runners (each
    subprocess imports torch), waited for by its test."""

    def __init__(self, name: str, root: Path, code: str, env: dict | None = None):
        self.name, self.root, self.code = name, root, code
        full_env = dict(os.environ)
        full_env.pop("PORTABLE_GEMM_TARGET", None)
        full_env["PYTHONPATH"] = str(root) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        self.env = full_env
        self.future = _POOL.submit(self._run)

    def _run(self):
        try:
            p = subprocess.run([sys.executable, "-c", self.code], cwd=self.root, env=self.env,
                               capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired as e:
            return None, None, e.stdout or "", f"hung for {TIMEOUT} s"
        reports = all_reports(p.stdout)
        # the prelude's report (import outcome) first; a case's own reports follow
        return p.returncode, reports[0] if reports else None, p.stdout, p.stderr

    def result(self):
        rc, rep, out, err = self.future.result()
        if rc is None:
            pytest.fail(f"{self.name}: {err}")
        return rc, rep, out, err



# ---------------------------------------------------------------------------------------
# Case preparation: each function damages a fresh copy and returns a Case.

def _write_manifest(pkg: Path, m: dict):
    (pkg / "lib" / "manifest.json").write_text(json.dumps(m, indent=1))


def prepare_cases(base: Path) -> dict[str, Case]:
    cases: dict[str, Case] = {}
    m0 = _manifest(INSTALLED)
    targets = _targets_newest_first(m0)
    newest, second, oldest = targets[0], targets[1], targets[-1]
    files = {t: b["file"] for t, b in _cpu_bindings(m0).items()}

    def new(name: str) -> tuple[Path, Path]:
        root = base / name
        root.mkdir()
        return root, copy_package(root)

    # one damage per target, newest first: missing, garbage, truncated inside the ELF
    # header, a valid ELF that is not a binding (the kernel library under the binding's
    # name); the loader must walk down to the oldest target and say why each was rejected
    # (as many damages as there are eligible targets to spare: 4 under torch >= 2.13, 2
    # under torch 2.11; cascade_damages() says which)
    root, pkg = new("cascade")
    lib = pkg / "lib"
    n = len(cascade_damages(targets))
    m = json.loads(json.dumps(m0))
    for i, t in enumerate(targets[:n]):
        if i == 0:
            (lib / files[t]).unlink()
        elif i == 1:
            (lib / files[t]).write_bytes(hashlib.sha512(b"x").digest() * 4096)
        elif i == 2:
            (lib / files[t]).write_bytes((lib / files[t]).read_bytes()[:100])
        else:
            shutil.copy2(lib / "libportable_gemm_kernels.so", lib / files[t])
            for b in m["binaries"]:
                if b.get("target") == t and b.get("kind") == "binding":
                    b["sha256"] = hashlib.sha256((lib / files[t]).read_bytes()).hexdigest()
    _write_manifest(pkg, m)
    cases["cascade"] = Case("cascade", root, script(root))

    # truncated to half its size: past the ELF headers, inside the segments
    root, pkg = new("truncated_half")
    f = pkg / "lib" / files[newest]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    cases["truncated_half"] = Case("truncated_half", root, script(root))

    # every binding garbage: nothing to fall back to
    root, pkg = new("all_garbage")
    for i, t in enumerate(targets):
        (pkg / "lib" / files[t]).write_bytes([b"", b"\x7fELF garbage" * 100, b"text"][i % 3])
    cases["all_garbage"] = Case("all_garbage", root, script(root))

    # the kernel library every binding needs is missing
    root, pkg = new("kernels_missing")
    (pkg / "lib" / "libportable_gemm_kernels.so").unlink()
    cases["kernels_missing"] = Case("kernels_missing", root, script(root))

    # manifest missing / unparsable / not a manifest / wrong types
    root, pkg = new("manifest_missing")
    (pkg / "lib" / "manifest.json").unlink()
    cases["manifest_missing"] = Case("manifest_missing", root, script(root))

    root, pkg = new("manifest_unparsable")
    (pkg / "lib" / "manifest.json").write_text(json.dumps(m0)[:200])
    cases["manifest_unparsable"] = Case("manifest_unparsable", root, script(root))

    root, pkg = new("manifest_no_binaries")
    _write_manifest(pkg, {k: v for k, v in m0.items() if k != "binaries"})
    cases["manifest_no_binaries"] = Case("manifest_no_binaries", root, script(root))

    root, pkg = new("manifest_not_object")
    (pkg / "lib" / "manifest.json").write_text("[1, 2, 3]")
    cases["manifest_not_object"] = Case("manifest_not_object", root, script(root))

    # an entry without "file" (manifest hand-edited / damaged)
    root, pkg = new("manifest_entry_no_file")
    m = json.loads(json.dumps(m0))
    for b in m["binaries"]:
        if b.get("target") == newest and b.get("kind") == "binding":
            del b["file"]
    _write_manifest(pkg, m)
    cases["manifest_entry_no_file"] = Case("manifest_entry_no_file", root, script(root))

    # the manifest lies: the newest entry points at the second-newest binary
    root, pkg = new("manifest_lies_target")
    m = json.loads(json.dumps(m0))
    for b in m["binaries"]:
        if b.get("target") == newest and b.get("kind") == "binding":
            b["file"] = files[second]
            b["sha256"] = _cpu_bindings(m0)[second]["sha256"]
    _write_manifest(pkg, m)
    cases["manifest_lies_target"] = Case("manifest_lies_target", root, script(root))

    # the manifest's sha256 is wrong for an intact binary
    root, pkg = new("sha_mismatch")
    m = json.loads(json.dumps(m0))
    for b in m["binaries"]:
        if b.get("target") == newest and b.get("kind") == "binding":
            b["sha256"] = "0" * 64
    _write_manifest(pkg, m)
    vendor_dest = root / "vend_copy"
    cases["sha_mismatch"] = Case("sha_mismatch", root, script(root, f"""
from portable_gemm._vendor import vendor
try:
    vendor({str(vendor_dest)!r}, "sha_ns")
    report(vendor="accepted")
except RuntimeError as e:
    report(vendor=str(e), leftovers=sorted(p.name for p in __import__("pathlib").Path(ROOT).iterdir()))
"""))

    # the manifest lists a target newer than the runtime torch, with no file behind it
    root, pkg = new("manifest_future_target")
    m = json.loads(json.dumps(m0))
    m["binaries"].append({"kind": "binding", "device": "cpu", "target": "99.0", "file": "nope_t99.so",
                          "sha256": "0" * 64})
    _write_manifest(pkg, m)
    cases["manifest_future_target"] = Case("manifest_future_target", root, script(root))

    # a forced target newer than torch (torch.__version__ patched before the import)
    root, pkg = new("forced_newer")
    cases["forced_newer"] = Case("forced_newer", root,
                                 script(root, after_torch=f"torch.__version__ = '{second}.0'"),
                                 env={"PORTABLE_GEMM_TARGET": newest})

    # a forced target whose binary is broken: no silent fallback
    root, pkg = new("forced_broken")
    (pkg / "lib" / files[oldest]).write_bytes(b"garbage")
    cases["forced_broken"] = Case("forced_broken", root, script(root), env={"PORTABLE_GEMM_TARGET": oldest})

    # torch older than the oldest target
    root, pkg = new("torch_too_old")
    cases["torch_too_old"] = Case("torch_too_old", root, script(root, after_torch="torch.__version__ = '2.8.0'"))

    # CUDA binding entries present (garbage files) under a CPU-only torch: never opened
    root, pkg = new("cuda_entry_cpu_torch")
    m = json.loads(json.dumps(m0))
    for t in targets:
        name = f"portable_gemm_cuda_t{t.replace('.', '_')}.so"
        (pkg / "lib" / name).write_bytes(b"not a library")
        m["binaries"].append({"kind": "binding", "device": "cuda", "target": t, "file": name, "sha256": "0" * 64})
    _write_manifest(pkg, m)
    spy = ("import ctypes\nOPENED = []\n_CDLL = ctypes.CDLL\n"
           "class _Spy(_CDLL):\n"
           "    def __init__(self, name, *a, **k):\n"
           "        OPENED.append(os.path.basename(str(name)))\n"
           "        super().__init__(name, *a, **k)\n"
           "ctypes.CDLL = _Spy\n")
    cases["cuda_entry_cpu_torch"] = Case("cuda_entry_cpu_torch", root,
                                         script(root, "report(opened=OPENED, torch_cuda=torch.version.cuda)\n",
                                                after_torch=spy))

    # the same package imported twice: importlib.reload of the package (and of its ops module)
    root, pkg = new("reload")
    cases["reload"] = Case("reload", root, script(root, """
import importlib, warnings
first = pg.info()
with warnings.catch_warnings():
    warnings.simplefilter("error")          # re-importing the package itself is silent
    pg2 = importlib.reload(pg)
    pg2 = importlib.reload(pg2)
same = pg2.info()["target"] == first["target"] and pg2.info()["libraries"] == first["libraries"]
x = torch.randn(4, 64)
w = torch.randn(8, 64)
q, s = pg2.quantize_weight(w, bits=4, group_size=32)
y1 = pg2.mixed_linear(x, q, s, bits=4, group_size=32)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")         # torch notes the autograd kernel being re-registered
    importlib.reload(pg2.ops)
y2 = pg2.mixed_linear(x, q, s, bits=4, group_size=32)
xr = x.clone().requires_grad_()
pg2.mixed_linear(xr, q, s, bits=4, group_size=32).sum().backward()
report(same=same, equal=bool(torch.equal(y1, y2)), grad=xr.grad is not None and bool(torch.isfinite(xr.grad).all()),
       state=state())
"""))

    # a second, plain copy of the package (same namespace) under another import name:
    # refused with an ImportError; the first copy keeps working
    root, pkg = new("second_copy_same_ns")
    shutil.copytree(pkg, root / "pg_twin", ignore=shutil.ignore_patterns("__pycache__"))
    cases["second_copy_same_ns"] = Case("second_copy_same_ns", root, script(root, """
try:
    import pg_twin
    report(twin="imported")
except ImportError as e:
    a = torch.randn(3, 5); b = torch.randn(5, 2)
    report(twin=str(e), first_still_works=gemm_ok(pg.gemm(a, b), a, b), state=state())
"""))

    # alongside a vendored copy (made by the CLI of the copy): the vendored copy's newest
    # binding is then damaged, so it falls back on its own while the original namespace
    # keeps the newest target; the two namespaces are independent
    root, pkg = new("vendored")
    vend = subprocess.run([sys.executable, "-m", "portable_gemm", "vendor", "--into", str(root / "vend_pkg"),
                           "--namespace", "vend_ns"], cwd=root, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    if (root / "vend_pkg" / "lib" / files[newest]).exists():
        (root / "vend_pkg" / "lib" / files[newest]).write_bytes(b"garbage")
    cases["vendored"] = Case("vendored", root, script(root, f"""
VEND_RC = {vend.returncode}
VEND_ERR = {vend.stderr[-2000:]!r}
import vend_pkg
a = torch.randn(6, 9); b = torch.randn(9, 4)
vi = vend_pkg.info()
NS = "vend_ns"
vstate = state()
report(vend_rc=VEND_RC, vend_err=VEND_ERR, vend_target=vi["target"], vend_ns=vi["namespace"],
       vend_candidates={{c["target"]: c["status"] for c in vi["candidates"]}},
       equal=bool(torch.equal(vend_pkg.gemm(a, b), pg.gemm(a, b))),
       direct=bool(torch.equal(torch.ops.vend_ns.gemm(a, b, None, 0), torch.ops.portable_gemm.gemm(a, b, None, 0))),
       vend_state=vstate, main_target=pg.info()["target"])
"""))
    return cases


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    global _POOL
    _POOL = ThreadPoolExecutor(max_workers=PARALLEL)
    try:
        yield prepare_cases(tmp_path_factory.mktemp("faults"))
    finally:
        _POOL.shutdown(wait=True, cancel_futures=True)
        _POOL = None


def targets():
    return _targets_newest_first(_manifest(INSTALLED))


# ---------------------------------------------------------------------------------------
# Checks

def all_reports(out: str) -> list[dict]:
    return [json.loads(line[2:]) for line in out.splitlines() if line.startswith("@@")]


def _no_signal(rc, err, name):
    assert rc is not None and rc >= 0, f"{name}: killed by signal {-rc}\n{err[-3000:]}"
    assert "Segmentation fault" not in err and "core dumped" not in err, err[-3000:]


def expect_fallback(case: Case, reason_re: str):
    rc, rep, out, err = case.result()
    _no_signal(rc, err, case.name)
    assert rc == 0, f"{case.name}: expected a clean fallback, exit {rc}\n{err[-3000:]}"
    ts = targets()
    assert rep["ok"] and rep["gemm"], rep
    assert rep["target"] == ts[1], f"{case.name}: expected fallback to {ts[1]}, got {rep['target']}"
    status, reason = rep["candidates"][ts[0]]
    assert status == "rejected", rep["candidates"]
    import re
    assert re.search(reason_re, reason), f"{case.name}: reason {reason!r} does not match {reason_re!r}"
    assert rep["candidates"][ts[1]][0] == "loaded"
    assert all(v == [True, True] for v in rep["state"].values()), rep["state"]
    return rep


def expect_import_error(case: Case, *needles: str):
    rc, rep, out, err = case.result()
    _no_signal(rc, err, case.name)
    assert rc == 1, f"{case.name}: expected exit status 1 (ImportError), got {rc}\n{err[-3000:]}"
    assert rep is not None and rep["ok"] is False, f"{case.name}: no ImportError report\n{out}\n{err[-3000:]}"
    # the last traceback (the exception that ended the interpreter) is the ImportError
    last_tb = err[err.rfind("Traceback (most recent call last):"):]
    assert any(ln.startswith("ImportError: ") for ln in last_tb.splitlines()), \
        f"{case.name}: the interpreter did not end in an ImportError:\n{err[-2000:]}"
    for n in needles:
        assert n in rep["error"], f"{case.name}: {n!r} not in the ImportError message:\n{rep['error']}"
    assert all(v == [False, False] for v in rep["state"].values()), \
        f"{case.name}: half-registered namespace after a failed import: {rep['state']}"
    return rep


def cascade_damages(ts: list[str]) -> list[str]:
    """Expected rejection reasons, newest target first: one damage per eligible target but
    the oldest, which must then be the one loaded."""
    return [r"is missing from",
            r"failed to load: .*(not a 64-bit little-endian ELF|invalid ELF header)",
            r"failed to load: .*(truncated|not a 64-bit little-endian ELF|file too short)",
            r"not a portable_gemm binding \(no entry points\)"][: len(ts) - 1]


def test_damaged_bindings_fall_back_one_by_one(cases):
    rc, rep, out, err = cases["cascade"].result()
    _no_signal(rc, err, "cascade")
    assert rc == 0, err[-3000:]
    ts = targets()
    want = cascade_damages(ts)
    assert len(want) >= 2, f"needs a torch with >= 3 eligible targets, got {ts}"
    assert rep["ok"] and rep["gemm"] and rep["target"] == ts[len(want)], rep
    import re
    for t, pattern in zip(ts, want):
        status, reason = rep["candidates"][t]
        assert status == "rejected" and re.search(pattern, reason), (t, status, reason)
    assert rep["candidates"][ts[len(want)]][0] == "loaded"
    assert all(v == [True, True] for v in rep["state"].values()), rep["state"]


def test_binding_truncated_falls_back(cases):
    # (before the ELF extent / sha256 check, this was SIGBUS inside dlopen)
    expect_fallback(cases["truncated_half"], r"failed to load: .*(truncated|sha256)")


def test_all_bindings_broken_is_an_import_error(cases):
    rep = expect_import_error(cases["all_garbage"], "no binding could be loaded for torch")
    for t in targets():
        assert f"{t}: rejected - failed to load" in rep["error"], rep["error"]


def test_all_bindings_broken_message_says_what_to_do(cases):
    rep = expect_import_error(cases["all_garbage"])
    assert "reinstall" in rep["error"]


def test_kernel_library_missing_is_an_import_error(cases):
    expect_import_error(cases["kernels_missing"], "libportable_gemm_kernels.so is missing", "reinstall the wheel")


def test_manifest_missing(cases):
    # the advice reinstalls this release and keeps the installed torch
    expect_import_error(cases["manifest_missing"], "manifest.json is missing",
                        "reinstall the wheel (pip install --force-reinstall --no-deps with the wheel file",
                        f"or portable-gemm=={metadata.version('portable-gemm')} from your package index")


def test_manifest_unparsable(cases):
    expect_import_error(cases["manifest_unparsable"], "cannot read", "reinstall the wheel")


def test_manifest_without_binaries(cases):
    expect_import_error(cases["manifest_no_binaries"], "lists no binaries", "reinstall the wheel")


def test_manifest_not_an_object(cases):
    # (was AttributeError: 'list' object has no attribute 'get')
    expect_import_error(cases["manifest_not_object"], "lists no binaries", "reinstall the wheel")


def test_manifest_entry_without_file(cases):
    # (was KeyError('file') out of _load_binding)
    expect_fallback(cases["manifest_entry_no_file"], r"names no file")


def test_manifest_lying_about_target_falls_back(cases):
    ts = targets()
    expect_fallback(cases["manifest_lies_target"], rf"reports target {ts[1]}, but the manifest says {ts[0]}")


def test_sha_mismatch_rejects_that_target(cases):
    expect_fallback(cases["sha_mismatch"], r"differs from the build manifest \(sha256")


def test_sha_mismatch_vendor_refuses(cases):
    rc, rep, out, err = cases["sha_mismatch"].result()
    _no_signal(rc, err, "sha_mismatch")
    assert rc == 0, err[-3000:]
    vend = all_reports(out)[-1]
    assert "does not match the manifest's sha256" in vend["vendor"], vend
    assert not [n for n in vend["leftovers"] if n.startswith(".vend_copy") or n == "vend_copy"], vend["leftovers"]


def test_manifest_future_target_is_not_tried(cases):
    rc, rep, out, err = cases["manifest_future_target"].result()
    _no_signal(rc, err, "manifest_future_target")
    assert rc == 0, err[-3000:]
    assert rep["target"] == targets()[0]
    status, reason = rep["candidates"]["99.0"]
    assert status == "rejected" and "needs torch >= 99.0" in reason


def test_forced_target_newer_than_torch(cases):
    ts = targets()
    expect_import_error(cases["forced_newer"], f"PORTABLE_GEMM_TARGET={ts[0]} is newer than the installed torch")


def test_forced_broken_target_does_not_fall_back(cases):
    expect_import_error(cases["forced_broken"], f"{targets()[-1]}: rejected - failed to load")


def test_torch_older_than_minimum(cases):
    expect_import_error(cases["torch_too_old"], "requires torch >= 2.9; found torch 2.8.0")


def test_cuda_binding_not_tried_under_cpu_torch(cases):
    rc, rep, out, err = cases["cuda_entry_cpu_torch"].result()
    _no_signal(rc, err, "cuda_entry_cpu_torch")
    assert rc == 0, err[-3000:]
    reports = [json.loads(line[2:]) for line in out.splitlines() if line.startswith("@@")]
    loaded, spy = reports[0], reports[-1]
    if spy["torch_cuda"] is not None:
        pytest.skip("this torch has CUDA: the CPU-only rule does not apply")
    assert loaded["cuda"]["loaded"] is False
    assert "CPU-only build; CUDA binding not tried" in loaded["cuda"]["reason"]
    assert not [f for f in spy["opened"] if "cuda" in f], spy["opened"]
    assert "cuda" not in loaded["libraries"]


def test_reload_is_harmless(cases):
    rc, rep, out, err = cases["reload"].result()
    _no_signal(rc, err, "reload")
    assert rc == 0, err[-3000:]
    rep = all_reports(out)[-1]
    assert rep["same"] and rep["equal"] and rep["grad"], rep
    assert all(v == [True, True] for v in rep["state"].values())


def test_second_copy_same_namespace_is_refused(cases):
    rc, rep, out, err = cases["second_copy_same_ns"].result()
    _no_signal(rc, err, "second_copy_same_ns")
    assert rc == 0, err[-3000:]
    rep = all_reports(out)[-1]
    assert rep["twin"] != "imported", "a second copy registered over torch.ops.portable_gemm"
    assert ("torch.ops.portable_gemm is already defined in this process, by the package portable_gemm"
            in rep["twin"]), rep["twin"]
    assert "candidates:" not in rep["twin"], "the twin tried its older targets too"
    assert rep["first_still_works"]
    assert all(v == [True, True] for v in rep["state"].values())


def test_alongside_vendored_copy(cases):
    rc, rep, out, err = cases["vendored"].result()
    _no_signal(rc, err, "vendored")
    assert rc == 0, err[-3000:]
    rep = all_reports(out)[-1]
    ts = targets()
    assert rep["vend_rc"] == 0, rep["vend_err"]
    assert rep["vend_ns"] == "vend_ns"
    assert rep["main_target"] == ts[0] and rep["vend_target"] == ts[1]
    assert rep["vend_candidates"][ts[0]] == "rejected"
    assert rep["equal"] and rep["direct"]
    assert all(v == [True, True] for v in rep["vend_state"].values())

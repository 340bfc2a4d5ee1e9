"""The source distribution that the release workflow publishes: built from this tree as
`pipx run build --sdist` builds it (or the file PG_SDIST names: the workflow's sdist job
tests the one it uploads), it must hold every tracked file a build reads, none of the working
tree's ignored build products, and the licences; and it must build, without build isolation
(the README's source build), into a wheel that loads and computes.

The build from the sdist is CPU only (-DPORTABLE_GEMM_CUDA=OFF): the CUDA sources are in the
sdist like every other tracked file under src/, and the CUDA build itself is what every
other wheel of the suite is; here the question is what the sdist carries."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_close, dequant_ref, gemm_ref, run_python

try:
    import scikit_build_core
    try:
        import tomllib
    except ImportError:  # Python 3.10: scikit-build-core depends on tomli there
        import tomli as tomllib
    from packaging.version import Version  # a dependency of scikit-build-core

    if Version(scikit_build_core.__version__) < Version("0.11"):
        pytestmark = pytest.mark.skip(reason=f"scikit-build-core {scikit_build_core.__version__} < 0.11, "
                                             "which the build needs (build-system.requires)")
except ImportError:  # e.g. cibuildwheel's test venv or the abi3 venv: no build tools there
    pytestmark = pytest.mark.skip(reason="scikit-build-core is not installed (ci/dev.sh installs it)")

# What a build reads, as paths from the repository root (files, or folders taken whole);
# the licence files it installs too are checked through license_files().
BUILD_INPUTS = ("pyproject.toml", "CMakeLists.txt", "README.md", "cmake", "include", "src",
                "python", "version_matrix")
# What must never be in it: the ignored products of a build or a test run in the tree.
NEVER = ("build/", "dist/", "dist-abi3/", ".venv", ".cache/", "__pycache__", ".git/")


def git_files(*args: str) -> set[str]:
    # core.excludesFile off: scikit-build-core reads the repository's .gitignore files only,
    # not a user's global ignores (an editor's files would go into the sdist)
    out = subprocess.run(["git", "-c", "core.excludesFile=/dev/null", "ls-files", "-z", *args], cwd=REPO,
                         capture_output=True, check=True, timeout=60).stdout.decode()
    return {f for f in out.split("\0") if f}


def project() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def license_patterns() -> list[str]:
    return project()["license-files"]


def committable() -> set[str]:
    """The files git would commit: tracked, or new and not ignored."""
    return git_files() | git_files("--others", "--exclude-standard")


def license_files() -> list[str]:
    return sorted(f for f in committable() if any(fnmatch.fnmatch(f, p) for p in license_patterns()))


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the sdist is built from one, and checked against git's file list")
    if os.environ.get("PG_SDIST"):
        return Path(os.environ["PG_SDIST"]).resolve()
    out = tmp_path_factory.mktemp("sdist")
    # scikit-build-core's PEP 517 hook, as `python -m build --sdist` calls it (in the tree).
    proc = subprocess.run([sys.executable, "-c",
                           "import sys, scikit_build_core.build as b; print(b.build_sdist(sys.argv[1]))",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = proc.stdout.strip().splitlines()[-1]
    return out / name


def members(sdist: Path) -> tuple[str, list[str]]:
    with tarfile.open(sdist) as t:
        names = [m.name for m in t.getmembers() if m.isfile()]
    top = {n.split("/", 1)[0] for n in names}
    assert len(top) == 1, top
    return top.pop(), [n.split("/", 1)[1] for n in names]


def test_sdist_holds_what_a_build_reads_and_no_build_products(sdist):
    top, names = members(sdist)
    assert top == f"portable_gemm-{project()['version']}", top
    have = set(names)
    tracked = git_files()
    needed = {f for f in tracked
              if any(f == p or f.startswith(p + "/") for p in BUILD_INPUTS)}
    assert len(needed) > 50, sorted(needed)  # the tree's sources, not an empty selection
    assert not needed - have, sorted(needed - have)
    for f in license_files():
        assert f in have, f
    leaked = sorted(n for n in names if any(n.startswith(p) or f"/{p}" in n for p in NEVER))
    assert not leaked, leaked[:20]
    # Everything else is a file git would commit: nothing ignored, so nothing a build or a
    # test run left in the tree.
    extra = sorted(have - committable() - {"PKG-INFO"})
    assert not extra, extra[:20]
    # ... except the committed benchmark results, which stay in the repository.
    results = sorted(n for n in names if n.startswith("bench/results/"))
    assert not results, results[:10]
    scripts = {f for f in tracked if f.startswith("bench/") and f.endswith(".py")}
    assert scripts and not scripts - have, sorted(scripts - have)
    assert sdist.stat().st_size < 2 << 20, f"{sdist.stat().st_size / 2**20:.1f} MiB"


def test_sdist_metadata_names_the_license_and_its_files(sdist):
    top, _ = members(sdist)
    with tarfile.open(sdist) as t:
        pkg_info = t.extractfile(f"{top}/PKG-INFO").read().decode()
    assert re.search(r"^Metadata-Version: 2\.[4-9]$", pkg_info, re.M), pkg_info[:200]
    assert re.search(r"^License-Expression: BSD-3-Clause$", pkg_info, re.M), pkg_info[:400]
    listed = sorted(re.findall(r"^License-File: (.+)$", pkg_info, re.M))
    assert listed == license_files(), listed
    # NOTICE names every third-party licence file it points to, and each exists.
    notice = (REPO / "NOTICE").read_text()
    for ref in re.findall(r"LICENSES/[\w.-]+\.txt", notice):
        assert (REPO / ref).is_file(), ref
    assert set(re.findall(r"LICENSES/[\w.-]+\.txt", notice)) == \
        {f for f in license_files() if f.startswith("LICENSES/")}


@pytest.mark.slow
def test_sdist_builds_a_wheel_that_loads_and_computes(sdist, tmp_path):
    """The README's source build, from the sdist: no isolation, against the torch installed
    here (its headers), CPU only. ~1 minute on 2 cores."""
    with tarfile.open(sdist) as t:
        # the "data" filter (no links out, no special files) where this Python has it (3.10.12+)
        t.extractall(tmp_path / "src", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    src = tmp_path / "src" / members(sdist)[0]
    env = {k: v for k, v in os.environ.items() if k != "CMAKE_ARGS"}
    print(f"building a CPU-only wheel from {sdist.name} (no isolation) ...", flush=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path / "wheel"),
                           "-C", "cmake.define.PORTABLE_GEMM_CUDA=OFF",
                           "-C", f"build-dir={tmp_path / 'build'}", str(src)],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (whl,) = (tmp_path / "wheel").glob("portable_gemm-*.whl")
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        z.extractall(unpacked)
    bindings = sorted(n for n in names if re.match(r"portable_gemm/lib/portable_gemm_\w+\.so$", n))
    targets = [t["version"] for t in json.loads((REPO / "version_matrix" / "matrix.json").read_text())["targets"]]
    assert len(targets) >= 5, targets
    assert bindings == sorted(f"portable_gemm/lib/portable_gemm_cpu_t{v.replace('.', '_')}.so" for v in targets), bindings
    lic = sorted(n.split(".dist-info/licenses/", 1)[1] for n in names if ".dist-info/licenses/" in n and not n.endswith("/"))
    assert lic == license_files(), lic
    manifest = json.loads((unpacked / "portable_gemm/lib/manifest.json").read_text())
    assert manifest["source"] is None, manifest["source"]  # no git checkout to name a commit of
    # The built package, not the installed one, loads under this torch and computes; its
    # outputs come back in a file and are checked here against the float64 references.
    check = r"""
import sys, torch, portable_gemm as pg
root, out = sys.argv[1], sys.argv[2]
assert pg.__file__.startswith(root), pg.__file__
info = pg.info()
assert info["target"] is not None and all(p.startswith(root) for p in info["libraries"].values()), info
g = torch.Generator().manual_seed(0)
a = torch.randn(7, 130, generator=g); b = torch.randn(130, 33, generator=g)
w = torch.randn(33, 256, generator=g)
x = torch.randn(3, 256, generator=g).bfloat16()
q, s = pg.quantize_weight(w, bits=4, group_size=64)
torch.save({"a": a, "b": b, "gemm": pg.gemm(a, b), "x": x, "q": q, "s": s,
            "mixed": pg.mixed_linear(x, q, s, bits=4, group_size=64)}, out)
print("target", info["target"])
"""
    out = tmp_path / "outputs.pt"
    run = run_python(check, env={"PYTHONPATH": str(unpacked)}, args=["-c", check, str(unpacked), str(out)])
    assert run.returncode == 0, run.stdout + run.stderr
    r = torch.load(out)
    assert_close(r["gemm"], gemm_ref(r["a"], r["b"]), torch.float32, label="gemm")
    ref = r["x"].double() @ dequant_ref(r["q"], r["s"], 4, 64).T
    assert_close(r["mixed"], ref, torch.bfloat16, label="mixed_linear int4 g64")

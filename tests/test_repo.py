"""Repository and artefact checks: the README's matrix is generated, no machine paths leak
into tracked files, and the built wheel's tags match what is inside it."""

import os
import re
import subprocess
import sys
import zipfile

import pytest
from _tree import tree_files
from conftest import REPO, tree_license_files


def test_readme_matrix_is_generated():
    proc = subprocess.run([sys.executable, str(REPO / "ci" / "readme_matrix.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_no_machine_paths_in_tracked_files():
    files = tree_files()
    assert len(files) > 100, len(files)
    bad = []
    for f in files:
        p = REPO / f
        if p.suffix in {".json", ".png"} or not p.is_file():
            continue
        text = p.read_text(errors="replace")
        for pat in ("/wor" "k/", "/roo" "t/", "/tmp/" "dev"):  # split so this file does not match itself
            if pat in text:
                bad.append(f"{f}: {pat}")
    assert not bad, bad


def wheels():
    # PG_DIST: the folder `ci/dev.sh wheel` built into (dist-abi3 for `ci/dev.sh abi3`)
    return sorted((REPO / os.environ.get("PG_DIST", "dist")).glob("portable_gemm-*.whl"))


@pytest.mark.skipif(not wheels(), reason="no wheel in $PG_DIST or dist/ (ci/dev.sh wheel builds one)")
def test_wheel_tags_match_contents():
    for whl in wheels():
        with zipfile.ZipFile(whl) as z:
            names = z.namelist()
            wheel_meta = z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        tags = re.findall(r"^Tag: (.+)$", wheel_meta, re.M)
        assert len(tags) == 1, tags
        py, abi, plat = tags[0].split("-")
        ext = [n for n in names if re.match(r"portable_gemm/_dlpack\..*so$", n)]
        assert len(ext) == 1, ext
        if ".abi3." in ext[0]:
            assert (py, abi) == ("cp312", "abi3"), tags
        else:
            m = re.search(r"cpython-(\d)(\d+)-", ext[0])
            assert (py, abi) == (f"cp{m[1]}{m[2]}", f"cp{m[1]}{m[2]}"), (tags, ext)
        assert plat.endswith("x86_64") or plat.endswith("aarch64"), plat
        bindings = [n for n in names if re.match(r"portable_gemm/lib/portable_gemm_cpu_t\d+_\d+\.so$", n)]
        assert len(bindings) == 5, bindings
        assert "portable_gemm/lib/manifest.json" in names


@pytest.mark.skipif(not wheels(), reason="no wheel in $PG_DIST or dist/ (ci/dev.sh wheel builds one)")
def test_wheel_carries_the_licenses():
    """LICENSE, NOTICE (what the binaries hold of other projects) and those projects' notices
    travel in every wheel's .dist-info/licenses and in portable_gemm/licenses, as the files of
    this tree, and METADATA names the licence (PEP 639)."""
    expected = tree_license_files()
    for whl in wheels():
        with zipfile.ZipFile(whl) as z:
            names = z.namelist()
            # (auditwheel's repaired zip also lists the folders: names ending in "/")
            got = {n.split(".dist-info/licenses/", 1)[1]: z.read(n) for n in names
                   if ".dist-info/licenses/" in n and not n.endswith("/")}
            # and in the package itself, where a vendored copy takes them from
            in_pkg = {n[len("portable_gemm/licenses/"):]: z.read(n) for n in names
                      if n.startswith("portable_gemm/licenses/") and not n.endswith("/")}
            metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert got == expected, (whl.name, sorted(got))
        assert in_pkg == expected, (whl.name, sorted(in_pkg))
        assert re.search(r"^License-Expression: BSD-3-Clause$", metadata, re.M), whl.name
        assert sorted(re.findall(r"^License-File: (.+)$", metadata, re.M)) == sorted(expected), whl.name

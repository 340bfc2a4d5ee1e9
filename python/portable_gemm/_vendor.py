"""`python -m portable_gemm vendor --into DIR --namespace NS`: copy this installed package
(loader, wrappers, every binary and the manifest) into DIR as a self-contained package whose
ops register under torch.ops.NS. Nothing is recompiled: the bindings take the namespace at
load time. The copy is written to a temporary folder and renamed into place, so an
interrupted run never leaves a half-written package."""

from __future__ import annotations

import hashlib
import json
import keyword
import os
import re
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What a vendored copy needs: Python sources, lib/ (binaries + manifest); headers and the
# CMake package are for C++ consumers of the original wheel.
SKIP = {"__pycache__", "include", "share", "_vendor.py"}


def _check_namespace(ns: str) -> None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ns) or keyword.iskeyword(ns):
        raise ValueError(f"namespace {ns!r} must be a Python identifier (it becomes torch.ops.{ns})")
    if ns in ("aten", "prim", "prims", "torch", "quantized", "_test"):
        raise ValueError(f"namespace {ns!r} belongs to torch; choose your project's own")


def vendor(into: str | os.PathLike, namespace: str, force: bool = False) -> Path:
    _check_namespace(namespace)
    dest = Path(into).resolve()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", dest.name):
        raise ValueError(f"{dest.name!r} is not importable as a package name")
    if dest.exists():
        if not force:
            raise FileExistsError(f"{dest} exists; pass --force to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        for item in HERE.iterdir():
            if item.name in SKIP:
                continue
            target = tmp / item.name
            if item.is_dir():
                shutil.copytree(item, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(item, target)
        (tmp / "_namespace.py").write_text(
            '"""The torch.ops namespace this vendored copy registers under (written by '
            '`python -m portable_gemm vendor`)."""\n\n'
            f"NAMESPACE = {namespace!r}\n")
        _verify_copy(HERE / "lib", tmp / "lib")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _verify_copy(src: Path, dst: Path) -> None:
    """Every binary the manifest lists matches its build sha256 (a damaged installation is not
    copied onward) and was copied whole."""
    manifest = json.loads((src / "manifest.json").read_text())
    for b in manifest["binaries"]:
        if not (src / b["file"]).is_file():
            raise RuntimeError(f"{b['file']} is missing from {src}; reinstall portable_gemm")
        digest = hashlib.sha256((src / b["file"]).read_bytes()).hexdigest()
        if digest != b.get("sha256"):
            raise RuntimeError(f"{b['file']} does not match the manifest's sha256; reinstall portable_gemm")
        if hashlib.sha256((dst / b["file"]).read_bytes()).hexdigest() != digest:
            raise RuntimeError(f"copying {b['file']} produced a different file; check the destination disk")

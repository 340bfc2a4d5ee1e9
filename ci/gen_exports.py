#!/usr/bin/env python3
"""Record the stable-ABI C symbols that each torch release really exports.

For every runtime release named in version_matrix/matrix.json (the verified
runtimes and the refused ones), fetch ONLY the torch wheel from PyPI (no
dependencies, nothing installed), pull torch/lib/{libtorch_cpu,libtorch_cuda,
libc10}.so out of the zip, list their defined dynamic symbols with
`nm -D --defined-only`, keep those matching ^(aoti_torch_|torch_) and write

    version_matrix/exports/torch-<ver>.json
    {"torch": ver, "wheel": filename, "sha256": hex,
     "libraries": {"libtorch_cpu.so": [...], "libtorch_cuda.so": [...],
                   "libc10.so": [...]}}

The wheel is deleted right after extraction. The output is small and meant to
be committed: ci/symbol_audit.py and tests/test_symbol_audit.py read it and
need no network.

Usage:
    python ci/gen_exports.py                 # every release in matrix.json
    python ci/gen_exports.py 2.9.1 2.13.0    # just these
    python ci/gen_exports.py --force         # refetch even if the json exists

The wheel is fetched with pip (the ordinary client) for CPython 3.11 /
manylinux_2_28_x86_64; the libtorch export list does not depend on the Python
version. The machine's pip configuration (a local find-links folder and a
torch<=... constraint) is bypassed so that every release comes from PyPI.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "version_matrix" / "matrix.json"
EXPORTS = ROOT / "version_matrix" / "exports"
LIBS = ("libtorch_cpu.so", "libtorch_cuda.so", "libc10.so")
SYMBOL_RE = re.compile(r"^(aoti_torch_|torch_)")

PY_VERSION = "3.11"
PLATFORM = "manylinux_2_28_x86_64"


def log(msg: str) -> None:
    print(f"[gen_exports {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def releases_from_matrix() -> list[str]:
    m = json.loads(MATRIX.read_text())
    vers = [r["torch"] for r in m.get("refused", [])] + [r["torch"] for r in m["runtimes"]]
    seen: list[str] = []
    for v in vers:
        if v not in seen:
            seen.append(v)
    return sorted(seen, key=lambda v: tuple(int(x) for x in v.split(".")))


def pip_download(version: str, dest: Path) -> Path:
    env = dict(os.environ)
    # Bypass this machine's pip cap (torch<=...) and its local find-links /
    # extra indexes: we want the files PyPI serves.
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_CONSTRAINT"] = ""
    env.pop("PIP_FIND_LINKS", None)
    env.pop("PIP_EXTRA_INDEX_URL", None)
    env.pop("PIP_INDEX_URL", None)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
        "--only-binary=:all:", "--python-version", PY_VERSION, "--implementation", "cp",
        "--platform", PLATFORM, "--index-url", "https://pypi.org/simple",
        "--progress-bar", "off", "-d", str(dest), f"torch=={version}",
    ]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wheels = sorted(dest.glob("torch-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one torch wheel in {dest}, found {wheels}")
    return wheels[0]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def defined_symbols(so: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(so)], check=True,
                         capture_output=True, text=True).stdout
    syms = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        name = parts[2].split("@", 1)[0]  # strip any symbol version
        if SYMBOL_RE.match(name):
            syms.add(name)
    return sorted(syms)


def process(version: str, force: bool) -> dict:
    out = EXPORTS / f"torch-{version}.json"
    if out.exists() and not force:
        log(f"{version}: {out.relative_to(ROOT)} exists, skipping (use --force to refetch)")
        return json.loads(out.read_text())
    with tempfile.TemporaryDirectory(prefix=f"gen_exports_{version}_") as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        log(f"{version}: downloading torch wheel ...")
        whl = pip_download(version, tmp / "dl")
        size = whl.stat().st_size
        dt = time.time() - t0
        log(f"{version}: {whl.name} {size / 1e6:.0f} MB in {dt:.0f}s ({size / 1e6 / max(dt, 1e-3):.0f} MB/s)")
        digest = sha256(whl)
        libs: dict[str, list[str]] = {}
        with zipfile.ZipFile(whl) as zf:
            names = set(zf.namelist())
            for lib in LIBS:
                member = f"torch/lib/{lib}"
                if member not in names:
                    log(f"{version}: {member} not in wheel")
                    continue
                target = tmp / lib
                with zf.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                libs[lib] = defined_symbols(target)
                target.unlink()
        whl.unlink()  # delete the wheel right after extraction
        data = {"torch": version, "wheel": whl.name, "sha256": digest, "libraries": libs}
        EXPORTS.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        counts = ", ".join(f"{k}={len(v)}" for k, v in libs.items())
        log(f"{version}: wrote {out.relative_to(ROOT)} ({counts}) in {time.time() - t0:.0f}s")
        return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("versions", nargs="*", help="torch releases (default: all in matrix.json)")
    ap.add_argument("--force", action="store_true", help="refetch even when the json exists")
    args = ap.parse_args(argv)
    versions = args.versions or releases_from_matrix()
    log(f"releases: {' '.join(versions)}")
    failed = []
    t0 = time.time()
    for i, v in enumerate(versions, 1):
        log(f"[{i}/{len(versions)}] torch {v}")
        try:
            process(v, args.force)
        except Exception as e:  # keep going, report at the end
            log(f"{v}: FAILED: {e}")
            failed.append(v)
    log(f"done in {time.time() - t0:.0f}s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

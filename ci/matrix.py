#!/usr/bin/env python3
"""Prove, cell by cell, that ONE portable_gemm wheel loads and computes correctly on every
torch release that version_matrix/matrix.json names.

    python ci/matrix.py --wheel dist/portable_gemm-0.1.0-....whl
    python ci/matrix.py --runtimes 2.9.1,2.13.0 --out ci/out
    python ci/matrix.py                      # builds the wheel once (build_wheel) first

For each runtime (and each refused release) a fresh venv is made with uv in a temp dir,
`torch==X numpy pytest` installed from PyPI (uv's global cache is shared and hard-linked,
so after the first cu12.8 and cu13 cell a venv costs seconds), the SAME wheel file is
installed with --no-deps, and ci/cell_check.py runs inside it:

  runtimes: --expect-target <matrix expect_target>  (target, info(), every op vs float64,
            opcheck, torch.compile, CUDA binding loaded under a CUDA torch)
  refused:  --expect-error <matrix expect_error>    (ImportError with that text, normal exit)

The venv is deleted after its cell (the uv cache is kept). A table (runtime, CUDA flavour,
selected target, features, tests passed/failed, seconds) is printed and written to
OUT/matrix.md and OUT/matrix.json. Exit status 1 if any cell failed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "version_matrix" / "matrix.json"
CELL_CHECK = ROOT / "ci" / "cell_check.py"
RESULT_TAG = "CELL_RESULT "


def log(msg: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- the wheel

def build_wheel() -> Path:
    """Build the wheel ONCE with the project's own command (`bash ci/dev.sh wheel`: its venv,
    torch headers, CUDA when nvcc is found, auditwheel repair) and return its path."""
    log("building the wheel: bash ci/dev.sh wheel")
    t0 = time.time()
    subprocess.run(["bash", str(ROOT / "ci" / "dev.sh"), "wheel"], cwd=ROOT, check=True)
    wheels = sorted((ROOT / "dist").glob("portable_gemm-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise SystemExit("build_wheel: no portable_gemm-*.whl in dist/")
    log(f"built {wheels[-1].name} in {time.time() - t0:.0f}s")
    return wheels[-1]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- uv

def find_uv() -> str:
    for cand in (os.environ.get("UV"), shutil.which("uv"), str(Path(sys.executable).parent / "uv")):
        if cand and Path(cand).exists():
            return cand
    raise SystemExit("uv not found: pip install uv (or set UV=/path/to/uv)")


def uv_env(uv: str, venv_parent: Path) -> dict:
    env = dict(os.environ)
    # Hard links from uv's cache when the venv is on the cache's filesystem (seconds and no
    # disk per venv); a copy otherwise (uv would warn and copy anyway).
    cache = Path(subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, check=True).stdout.strip())
    cache.mkdir(parents=True, exist_ok=True)
    same_fs = os.stat(cache).st_dev == os.stat(venv_parent).st_dev
    env.setdefault("UV_LINK_MODE", "hardlink" if same_fs else "copy")
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env.setdefault("UV_HTTP_TIMEOUT", "300")
    return env


def run_logged(cmd: list[str], env: dict, cwd: Path, prefix: str, timeout: float) -> tuple[int, list[str]]:
    """Run, echo each line with a prefix, return (returncode, lines)."""
    lines: list[str] = []
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, bufsize=1)
    deadline = time.time() + timeout
    assert p.stdout is not None
    for line in p.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if not line.startswith(RESULT_TAG):
            print(f"{prefix}{line}", flush=True)
        if time.time() > deadline:
            p.kill()
            lines.append(f"killed after {timeout:.0f}s")
            break
    try:
        rc = p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
        lines.append(f"killed after {timeout:.0f}s")
    return rc, lines


# ----------------------------------------------------------------------------- one cell

def run_cell(cell: dict, wheel: Path, uv: str, python: str, work: Path, args) -> dict:
    ver = cell["torch"]
    refused = cell["kind"] == "refused"
    row = {"runtime": ver, "kind": cell["kind"], "cuda_flavour": cell.get("cuda"),
           "expect": cell.get("expect_error") if refused else cell["expect_target"],
           "target": None, "features": None, "passed": 0, "failed": 0, "status": "FAIL",
           "install_s": None, "check_s": None, "seconds": None, "error": None}
    t0 = time.time()
    venv = Path(tempfile.mkdtemp(prefix=f"pg_cell_{ver}_", dir=work))
    env = uv_env(uv, work)
    pre = f"  [{ver}] "
    try:
        log(f"cell torch {ver} ({cell['kind']}, {cell.get('cuda')}): creating venv {venv}")
        steps = [
            # --seed: pip/setuptools as in a plain `python -m venv` (torch.compile's inductor
            # imports setuptools on torch < 2.10 / Python 3.11, and torch declares it only for 3.12+)
            [uv, "venv", "-q", "--seed", "--python", python, str(venv)],
            [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
             f"torch=={ver}", "numpy", "pytest"],
            [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-deps",
             "--reinstall-package", "portable-gemm", str(wheel)],
        ]
        for cmd in steps:
            rc, lines = run_logged(cmd, env, work, pre, args.install_timeout)
            if rc != 0:
                row["error"] = f"`{' '.join(cmd[:3])} ...` exited {rc}: " + " | ".join(lines[-5:])
                return row
        row["install_s"] = round(time.time() - t0, 1)
        log(f"cell torch {ver}: installed in {row['install_s']:.0f}s; running cell_check")

        check_cmd = [str(venv / "bin" / "python"), str(CELL_CHECK)]
        check_cmd += (["--expect-error", cell["expect_error"]] if refused
                      else ["--expect-target", cell["expect_target"]])
        if args.allow_no_cuda:
            check_cmd.append("--allow-no-cuda")
        if args.skip_compile:
            check_cmd.append("--skip-compile")
        cenv = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PORTABLE_GEMM_TARGET")}
        cenv["VIRTUAL_ENV"] = str(venv)
        # a cold inductor cache per cell (deleted with the venv): torch.compile really compiles
        cenv["TORCHINDUCTOR_CACHE_DIR"] = str(venv / "inductor_cache")
        cenv["TRITON_CACHE_DIR"] = str(venv / "triton_cache")
        # inductor writes its precompiled headers (~140 MB a torch release) under
        # $TMPDIR/torchinductor_<user>, whatever TORCHINDUCTOR_CACHE_DIR says: a TMPDIR inside the
        # venv makes them go with it (repeated matrix runs had filled the machine's disk)
        (venv / "tmp").mkdir(exist_ok=True)
        cenv["TMPDIR"] = str(venv / "tmp")
        cenv["PATH"] = f"{venv / 'bin'}{os.pathsep}{cenv.get('PATH', '')}"
        t1 = time.time()
        rc, lines = run_logged(check_cmd, cenv, work, pre, args.cell_timeout)
        row["check_s"] = round(time.time() - t1, 1)
        result = None
        for line in lines:
            if line.startswith(RESULT_TAG):
                try:
                    result = json.loads(line[len(RESULT_TAG):])
                except ValueError:
                    pass
        if rc < 0:
            row["error"] = f"cell_check killed by signal {-rc}"
        elif result is None:
            row["error"] = f"cell_check exited {rc} without a result line: " + " | ".join(lines[-5:])
        if result is not None:
            row.update(passed=result.get("passed", 0), failed=result.get("failed", 0),
                       target=result.get("target"), features=result.get("features"),
                       torch_installed=result.get("torch"), torch_cuda=result.get("torch_cuda"),
                       cuda=result.get("cuda"), import_ms=result.get("import_ms"),
                       failures=result.get("failures"), import_error=result.get("error"))
            if not str(result.get("torch", "")).startswith(ver):
                row["error"] = f"venv holds torch {result.get('torch')}, not {ver}"
                row["failed"] += 1
        if rc == 0 and row["error"] is None and row["failed"] == 0:
            row["status"] = "ok"
        elif row["error"] is None:
            row["error"] = "; ".join(f"{f['check']}: {f['error'].splitlines()[0] if f['error'] else ''}"
                                     for f in (row.get("failures") or [])[:5]) or f"exit {rc}"
        return row
    finally:
        row["seconds"] = round(time.time() - t0, 1)
        if args.keep_venvs:
            log(f"cell torch {ver}: keeping {venv}")
        else:
            shutil.rmtree(venv, ignore_errors=True)
        log(f"cell torch {ver}: {row['status']} ({row['passed']} passed, {row['failed']} failed) "
            f"in {row['seconds']:.0f}s" + (f" - {row['error']}" if row["error"] else ""))


# ----------------------------------------------------------------------------- report

def features_text(f) -> str:
    if not f:
        return ""
    short = {"aoti_torch_get_current_cuda_stream": "aoti stream", "Stream::nativeHandle": "nativeHandle",
             "torch::stable::parallel_for": "stable parallel_for", "portable_gemm_pool": "own pool",
             "torch_openmp": "torch's OpenMP"}
    keys = [k for k in ("stream_api", "threading", "cuda_error_check") if f.get(k)]
    return ", ".join(f"{k}={short.get(str(f[k]), f[k])}" for k in keys)


def table(rows: list[dict]) -> list[str]:
    head = ["runtime", "CUDA", "expected", "selected target", "features", "cuda binding",
            "passed", "failed", "seconds", "status"]
    body = []
    for r in rows:
        refused = r["kind"] == "refused"
        cuda = r.get("cuda") or {}
        body.append([
            r["runtime"], str(r.get("cuda_flavour") or ""),
            ("refused" if refused else str(r["expect"])),
            ("ImportError" if refused and r["status"] == "ok" else str(r.get("target") or "-")),
            features_text(r.get("features")),
            ("" if refused else ("loaded" if cuda.get("loaded") else ("no" if r.get("torch_cuda") else "n/a (cpu torch)"))),
            str(r["passed"]), str(r["failed"]),
            f"{r['seconds']:.0f}" if r.get("seconds") is not None else "",
            r["status"],
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(b) for b in body]


def cells_from_matrix(matrix: dict, only: list[str] | None) -> list[dict]:
    cells = [{**r, "kind": "runtime"} for r in matrix["runtimes"]]
    cells += [{**r, "kind": "refused"} for r in matrix.get("refused", [])]
    if only:
        known = {c["torch"] for c in cells}
        unknown = [v for v in only if v not in known]
        if unknown:
            raise SystemExit(f"--runtimes names releases not in matrix.json: {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        cells = [c for c in cells if c["torch"] in only]
    return sorted(cells, key=lambda c: tuple(int(x) for x in c["torch"].split(".")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, help="the wheel to verify (default: build one with build_wheel())")
    ap.add_argument("--runtimes", help="comma-separated subset of matrix.json releases, e.g. 2.9.1,2.13.0")
    ap.add_argument("--out", type=Path, default=ROOT / "ci" / "out")
    ap.add_argument("--python", default="3.11", help="Python for the cell venvs (uv venv --python)")
    ap.add_argument("--matrix", type=Path, default=MATRIX)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the temporary venvs go (default: system temp; keep it on uv's cache filesystem)")
    ap.add_argument("--keep-venvs", action="store_true", help="do not delete the cell venvs (debugging)")
    ap.add_argument("--allow-no-cuda", action="store_true",
                    help="pass to cell_check: a wheel built without CUDA bindings is not a failure")
    ap.add_argument("--skip-compile", action="store_true", help="pass to cell_check: skip torch.compile")
    ap.add_argument("--install-timeout", type=float, default=1800)
    ap.add_argument("--cell-timeout", type=float, default=900)
    args = ap.parse_args(argv)

    matrix = json.loads(args.matrix.read_text())
    only = [v.strip() for v in args.runtimes.split(",") if v.strip()] if args.runtimes else None
    cells = cells_from_matrix(matrix, only)
    uv = find_uv()

    wheel = args.wheel.resolve() if args.wheel else build_wheel()
    if not wheel.is_file():
        raise SystemExit(f"no such wheel: {wheel}")
    digest = sha256(wheel)
    log(f"wheel {wheel.name}")
    log(f"sha256 {digest}")
    log(f"cells: {', '.join(c['torch'] + ('(refused)' if c['kind'] == 'refused' else '') for c in cells)}; "
        f"uv {subprocess.run([uv, '--version'], capture_output=True, text=True).stdout.strip()}")

    work = Path(tempfile.mkdtemp(prefix="pg_matrix_", dir=args.workdir))
    rows = []
    t0 = time.time()
    try:
        for i, cell in enumerate(cells, 1):
            log(f"[{i}/{len(cells)}] torch {cell['torch']}")
            rows.append(run_cell(cell, wheel, uv, args.python, work, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = time.time() - t0

    lines = table(rows)
    bad = [r for r in rows if r["status"] != "ok"]
    print()
    print("\n".join(lines))
    for r in bad:
        print(f"FAILED torch {r['runtime']}: {r['error']}")
    print(f"\n{len(rows) - len(bad)} cells ok, {len(bad)} failed, {total:.0f}s")

    args.out.mkdir(parents=True, exist_ok=True)
    md = [f"# portable_gemm version matrix", "",
          f"- wheel: `{wheel.name}`", f"- sha256: `{digest}`",
          f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", f"- python: {args.python}",
          f"- total: {total:.0f}s, {len(rows) - len(bad)} cells ok, {len(bad)} failed", ""] + lines
    if bad:
        md += ["", "## Failures", ""] + [f"- torch {r['runtime']}: {r['error']}" for r in bad]
    (args.out / "matrix.md").write_text("\n".join(md) + "\n")
    (args.out / "matrix.json").write_text(json.dumps(
        {"wheel": wheel.name, "sha256": digest, "python": args.python, "seconds": round(total, 1),
         "cells": rows}, indent=1, sort_keys=True) + "\n")
    log(f"wrote {args.out / 'matrix.md'} and {args.out / 'matrix.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Audit the binaries of a portable_gemm wheel against the real torch export lists.

    python ci/symbol_audit.py dist/portable_gemm-*.whl
    python ci/symbol_audit.py path/to/site-packages/portable_gemm      (or .../lib, or any dir above)

Every shared object in portable_gemm/lib is classified (lib/manifest.json first,
then the file name):

  kernel   libportable_gemm_kernels*.so       knows nothing of torch
  binding  portable_gemm_{cpu,cuda}_t<M>_<m>.so  one per stable-ABI target and device
  python   *.cpython-*.so / *.abi3.so           a Python extension (the torch-free door), in
                                                lib/ or beside it in portable_gemm/

and checked, with the export lists written by ci/gen_exports.py
(version_matrix/exports/torch-<ver>.json) for every runtime in
version_matrix/matrix.json:

  (a) each undefined aoti_torch_* / torch_* symbol of a binding is exported by
      libtorch_cpu.so / libc10.so (+ libtorch_cuda.so for a CUDA binding) of
      EVERY verified runtime whose major.minor >= the binding's target;
  (b) no undefined C++ symbol of c10::, at::, torch:: (the stable ABI is C; what
      the stable headers define is inline and never undefined) and no exported
      one either (a leaked weak c10::toString means -fvisibility=hidden is
      missing);
  (c) the kernel library has no undefined torch/c10/aoti symbol and no
      DT_NEEDED on a torch library;
  (d) no Py* symbol (nor libpython) in a binding or the kernel library;
  (e) prints per binary the symbols it uses that first appeared after 2.9, and
      the minimum runtime they imply;
  (f) CUDA bindings: target >= 2.13 imports torch_stream_native_handle and not
      aoti_torch_get_current_cuda_stream; targets < 2.13 the reverse;
  (g) a binding is linked (DT_NEEDED) to libtorch_cpu.so, a CUDA one also to
      libtorch_cuda.so (torch loads its libraries RTLD_LOCAL); a CPU binding
      must not need libtorch_cuda.so.

Exits 1 with a readable report on any violation, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MATRIX = ROOT / "version_matrix" / "matrix.json"
DEFAULT_EXPORTS = ROOT / "version_matrix" / "exports"

C_ABI_RE = re.compile(r"^(aoti_torch_|torch_)")
PY_RE = re.compile(r"^_?Py[A-Za-z_]")
TORCH_LIB_RE = re.compile(r"^lib(torch|c10|shm|caffe2)[A-Za-z0-9_]*\.so")
# anywhere in a demangled name (for undefined symbols: any reference to a torch C++ entity)
CXX_NS_RE = re.compile(r"(^|[^A-Za-z0-9_:])(c10|at|torch)::")
# a symbol that itself lives in c10::/at::/torch:: (function, method, vtable, typeinfo, guard
# variable): used for exported (defined) symbols, where std:: templates instantiated on
# torch::stable types are normal and not a leak (libstdc++ forces default visibility).
CXX_OWN_RE = re.compile(r"^_Z(T[VISHWT]|GV)?N[rVKRO]*(3c10|2at|5torch)(?=\d|E|I)")
BINDING_NAME_RE = re.compile(r"^portable_gemm_(cpu|cuda)_t(\d+)_(\d+)\.so$")

# (b) allowlist: undefined mangled symbols that may demangle to c10::/at::/torch::.
# Verified empty: a target-2.9 and a target-2.13 binding built from the stable
# headers (torch/csrc/stable/*, torch/headeronly/*) import only extern "C"
# aoti_torch_*/torch_* functions; everything C++ in those headers is inline or a
# template and is emitted (hidden) in the binding itself. Add an entry here only
# with a reason.
CXX_ALLOWLIST: dict[str, str] = {}

STREAM_NEW = "torch_stream_native_handle"
STREAM_OLD = "aoti_torch_get_current_cuda_stream"


def vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def mm(v: str) -> tuple[int, int]:
    k = vkey(v)
    return (k[0], k[1])


# ----------------------------------------------------------------------------- ELF helpers

def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def nm_symbols(path: Path, undefined: bool) -> dict[str, str]:
    """name -> nm type letter, dynamic symbols only, version suffix stripped."""
    flag = "--undefined-only" if undefined else "--defined-only"
    out = _run(["nm", "-D", flag, str(path)])
    syms: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if not parts:
            continue
        if undefined:
            if len(parts) < 2:
                continue
            typ, name = parts[-2], parts[-1]
        else:
            if len(parts) < 3:
                continue
            typ, name = parts[1], parts[2]
        syms[name.split("@", 1)[0]] = typ
    return syms


def needed(path: Path) -> list[str]:
    out = _run(["readelf", "-d", "-W", str(path)])
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def demangle(names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names) + "\n", check=True,
                         capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out))


# ----------------------------------------------------------------------------- inputs

@dataclass
class Binary:
    path: Path
    kind: str                 # binding | kernel | python | unknown
    device: str | None = None
    target: str | None = None
    source: str = "name"      # where kind/target came from
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def locate_lib_dir(arg: Path, tmp: Path) -> Path:
    if arg.is_file() and arg.suffix == ".whl":
        with zipfile.ZipFile(arg) as zf:
            names = zf.namelist()
            members = [n for n in names if re.search(r"(^|/)portable_gemm/lib/[^/]+$", n)]
            if not members:
                raise SystemExit(f"error: {arg} has no portable_gemm/lib/ files")
            # Python extension modules beside lib/ (the nanobind door): audited as torch-free
            members += [n for n in names if re.search(r"(^|/)portable_gemm/[^/]+\.so$", n)]
            for n in members:
                sub = "lib" if "/lib/" in "/" + n else ""
                dst = tmp / "portable_gemm" / sub / Path(n).name
                dst.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(n) as s, open(dst, "wb") as d:
                    shutil.copyfileobj(s, d)
        return tmp / "portable_gemm" / "lib"
    if arg.is_dir():
        for cand in (arg, arg / "lib", arg / "portable_gemm" / "lib"):
            if cand.name == "lib" and cand.is_dir():
                return cand
        hits = sorted(p for p in arg.rglob("lib") if p.is_dir() and p.parent.name == "portable_gemm")
        if hits:
            return hits[0]
        raise SystemExit(f"error: no portable_gemm/lib under {arg}")
    raise SystemExit(f"error: {arg} is neither a wheel nor a directory")


def _manifest_entries(obj) -> list[dict]:
    """Every dict in the manifest that names a file and has target/device/kind."""
    found: list[dict] = []

    def walk(o, key=None):
        if isinstance(o, dict):
            fname = next((o[k] for k in ("file", "filename", "name", "path", "library", "lib")
                          if isinstance(o.get(k), str) and o[k].endswith(".so")), None)
            if fname is None and key is not None and str(key).endswith(".so"):
                fname = key
            if fname and any(k in o for k in ("target", "device", "kind")):
                found.append({**o, "_file": Path(fname).name})
            for k, v in o.items():
                walk(v, k)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(obj)
    return found


def classify(lib_dir: Path) -> tuple[list[Binary], list[str]]:
    notes: list[str] = []
    manifest: dict[str, dict] = {}
    mpath = lib_dir / "manifest.json"
    if mpath.exists():
        try:
            for e in _manifest_entries(json.loads(mpath.read_text())):
                manifest[e["_file"]] = e
        except ValueError as e:
            notes.append(f"manifest.json unreadable ({e}); classifying by file name")
    else:
        notes.append("no lib/manifest.json; classifying by file name")

    bins: list[Binary] = []
    beside = [p for p in lib_dir.parent.glob("*.so")
              if lib_dir.parent.name == "portable_gemm" and (".cpython-" in p.name or p.name.endswith(".abi3.so"))]
    for p in sorted(lib_dir.iterdir()) + sorted(beside):
        if not (p.is_file() and (p.suffix == ".so" or ".so." in p.name)):
            continue
        e = manifest.get(p.name)
        m = BINDING_NAME_RE.match(p.name)
        b = Binary(p, "unknown")
        if p.name.startswith("libportable_gemm_kernels"):
            b.kind = "kernel"
        elif ".cpython-" in p.name or p.name.endswith(".abi3.so"):
            b.kind = "python"
        elif e is not None and e.get("target") is not None:
            b.kind, b.source = "binding", "manifest"
            b.target = str(e["target"])
            b.device = str(e.get("device") or (m.group(1) if m else "cpu")).lower()
            if m and (m.group(1) != b.device or mm(b.target) != (int(m.group(2)), int(m.group(3)))):
                b.notes.append(f"manifest says {b.device}/{b.target}, name says "
                               f"{m.group(1)}/{m.group(2)}.{m.group(3)}; using the manifest")
        elif m:
            b.kind, b.device, b.target = "binding", m.group(1), f"{m.group(2)}.{m.group(3)}"
        if e is not None and e.get("kind") in ("kernel", "kernels") and b.kind == "unknown":
            b.kind = "kernel"
        if b.device and b.device.startswith("cuda"):
            b.device = "cuda"
        bins.append(b)
    order = {"kernel": 0, "binding": 1, "python": 2, "unknown": 3}
    bins.sort(key=lambda b: (order[b.kind], b.device or "", vkey(b.target) if b.target else (), b.path.name))
    return bins, notes


def load_exports(matrix: dict, exports_dir: Path) -> tuple[dict[str, dict], list[str]]:
    wanted = [r["torch"] for r in matrix["runtimes"]] + [r["torch"] for r in matrix.get("refused", [])]
    exports: dict[str, dict] = {}
    missing: list[str] = []
    for f in exports_dir.glob("torch-*.json"):
        d = json.loads(f.read_text())
        exports[d["torch"]] = {k: set(v) for k, v in d["libraries"].items()}
    for v in wanted:
        if v not in exports:
            missing.append(v)
    return dict(sorted(exports.items(), key=lambda kv: vkey(kv[0]))), missing


# ----------------------------------------------------------------------------- checks

def allowed_libs(device: str | None) -> tuple[str, ...]:
    if device == "cuda":
        return ("libtorch_cpu.so", "libc10.so", "libtorch_cuda.so")
    return ("libtorch_cpu.so", "libc10.so")


def first_release(sym: str, libs: tuple[str, ...], exports: dict[str, dict]) -> str | None:
    for ver, lib in exports.items():
        if any(sym in lib.get(name, ()) for name in libs):
            return ver
    return None


def audit_binary(b: Binary, matrix: dict, exports: dict[str, dict]) -> None:
    und = nm_symbols(b.path, undefined=True)
    dfn = nm_symbols(b.path, undefined=False)
    deps = needed(b.path)
    mangled = [s for s in list(und) + list(dfn) if s.startswith("_Z")]
    dem = demangle(mangled)

    # (d) Python
    if b.kind != "python":
        py = sorted(s for s in list(und) + list(dfn) if PY_RE.match(s))
        if py:
            b.violations.append(f"(d) uses/exports Python C-API symbols: {', '.join(py[:10])}"
                                + (" ..." if len(py) > 10 else ""))
        libpy = [d for d in deps if d.startswith("libpython")]
        if libpy:
            b.violations.append(f"(d) DT_NEEDED on {', '.join(libpy)}")

    # (b) C++ torch symbols
    if b.kind != "python":
        bad_und = sorted((s, dem.get(s, s)) for s in und
                         if s.startswith("_Z") and CXX_NS_RE.search(dem.get(s, s))
                         and s not in CXX_ALLOWLIST)
        for s, d in bad_und:
            b.violations.append(f"(b) undefined C++ torch symbol {d}  [{s}]")
        bad_def = sorted((s, dem.get(s, s)) for s in dfn if CXX_OWN_RE.match(s))
        for s, d in bad_def:
            b.violations.append(f"(b) exports C++ torch symbol {d}  [{s}] "
                                "(build with -fvisibility=hidden)")

    torch_und = sorted(s for s in und if C_ABI_RE.match(s))
    torch_deps = [d for d in deps if TORCH_LIB_RE.match(d)]

    if b.kind in ("kernel", "python", "unknown"):
        # (c) torch-free
        label = {"kernel": "(c) kernel library", "python": "(c) python module",
                 "unknown": "(c) unclassified library"}[b.kind]
        if torch_und:
            b.violations.append(f"{label} has undefined torch symbols: {', '.join(torch_und)}")
        if torch_deps:
            b.violations.append(f"{label} has DT_NEEDED on torch libraries: {', '.join(torch_deps)}")
        if b.kind == "unknown":
            b.notes.append("not in the manifest and name not recognised: audited as torch-free")
        return

    # ---- bindings
    assert b.target is not None
    tgt = mm(b.target)
    libs = allowed_libs(b.device)

    # (g) linkage
    if "libtorch_cpu.so" not in deps:
        b.violations.append("(g) not linked to libtorch_cpu.so (torch loads it RTLD_LOCAL: "
                            "dlopen would fail with 'undefined symbol')")
    if b.device == "cuda" and "libtorch_cuda.so" not in deps:
        b.violations.append("(g) CUDA binding not linked to libtorch_cuda.so")
    if b.device != "cuda" and "libtorch_cuda.so" in deps:
        b.violations.append("(g) CPU binding needs libtorch_cuda.so (cannot load under a CPU-only torch)")

    # (a) every runtime >= target exports every used symbol
    runtimes = [r["torch"] for r in matrix["runtimes"] if mm(r["torch"]) >= tgt]
    b.notes.append(f"checked against runtimes {', '.join(runtimes) or '(none!)'}")
    if not runtimes:
        b.violations.append(f"(a) no runtime in matrix.json is >= target {b.target}")
    for rt in runtimes:
        ex = exports.get(rt)
        if ex is None:
            b.violations.append(f"(a) no export list for torch {rt}: run ci/gen_exports.py {rt}")
            continue
        have = set().union(*(ex.get(n, set()) for n in libs))
        miss = [s for s in torch_und if s not in have]
        if miss:
            elsewhere = []
            if b.device != "cuda":
                elsewhere = [s for s in miss if s in ex.get("libtorch_cuda.so", ())]
            detail = ", ".join(s + (" (only in libtorch_cuda.so)" if s in elsewhere else "") for s in miss)
            b.violations.append(f"(a) torch {rt} ({'+'.join(libs)}) does not export: {detail}")

    # (e) what ties the binary to its minimum
    newer: list[tuple[str, str]] = []
    min_needed = None
    for s in torch_und:
        fr = first_release(s, libs, exports)
        if fr is None:
            newer.append((s, "never exported"))
            continue
        if min_needed is None or vkey(fr) > vkey(min_needed):
            min_needed = fr
        if mm(fr) > (2, 9):
            newer.append((s, fr))
    b.symbols_after_29 = newer  # type: ignore[attr-defined]
    b.min_runtime = min_needed  # type: ignore[attr-defined]
    b.n_torch_symbols = len(torch_und)  # type: ignore[attr-defined]

    # (f) stream API per target (CUDA bindings)
    if b.device == "cuda":
        uses_new, uses_old = STREAM_NEW in und, STREAM_OLD in und
        if tgt >= (2, 13):
            if not uses_new:
                b.violations.append(f"(f) target {b.target} CUDA binding does not import {STREAM_NEW}")
            if uses_old:
                b.violations.append(f"(f) target {b.target} CUDA binding still imports {STREAM_OLD}")
        else:
            if not uses_old:
                b.violations.append(f"(f) target {b.target} CUDA binding does not import {STREAM_OLD}")
            if uses_new:
                b.violations.append(f"(f) target {b.target} CUDA binding imports {STREAM_NEW}")


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel_or_dir", type=Path)
    ap.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX)
    ap.add_argument("--exports", type=Path, default=DEFAULT_EXPORTS)
    ap.add_argument("--json", type=Path, help="also write the findings as JSON here")
    args = ap.parse_args(argv)

    for tool in ("nm", "readelf", "c++filt"):
        if shutil.which(tool) is None:
            print(f"error: {tool} not found (install binutils)", file=sys.stderr)
            return 2

    matrix = json.loads(args.matrix.read_text())
    exports, missing = load_exports(matrix, args.exports)

    with tempfile.TemporaryDirectory(prefix="symbol_audit_") as tmp:
        lib_dir = locate_lib_dir(args.wheel_or_dir, Path(tmp))
        bins, notes = classify(lib_dir)
        print(f"symbol audit of {args.wheel_or_dir} ({lib_dir})")
        print(f"export lists: {', '.join(exports) or 'none'}"
              + (f"; MISSING for {', '.join(missing)}" if missing else ""))
        for n in notes:
            print(f"note: {n}")
        if not bins:
            print("VIOLATION: no shared objects found in portable_gemm/lib")
            return 1
        for b in bins:
            audit_binary(b, matrix, exports)

    kinds = {k: [b for b in bins if b.kind == k] for k in ("binding", "kernel", "python", "unknown")}
    if not kinds["kernel"]:
        notes.append("no kernel library (libportable_gemm_kernels*.so) in the wheel")
    cuda_bindings = [b for b in kinds["binding"] if b.device == "cuda"]

    print()
    for b in bins:
        status = "FAIL" if b.violations else "ok"
        desc = b.kind + (f" {b.device} target {b.target} (from {b.source})" if b.kind == "binding" else "")
        print(f"[{status}] {b.path.name}: {desc}")
        if b.kind == "binding":
            print(f"    {getattr(b, 'n_torch_symbols', 0)} aoti_torch_/torch_ imports; "
                  f"implied minimum runtime: {getattr(b, 'min_runtime', None) or 'n/a'}")
            after = getattr(b, "symbols_after_29", [])
            if after:
                print("    symbols added after 2.9 (first release exporting them):")
                for s, fr in sorted(after, key=lambda x: (vkey(x[1]) if x[1][0].isdigit() else (99,), x[0])):
                    print(f"      {fr:>8}  {s}")
            else:
                print("    symbols added after 2.9: none")
        for n in b.notes:
            print(f"    note: {n}")
        for v in b.violations:
            print(f"    VIOLATION {v}")
    if not cuda_bindings:
        print("\n(f) skipped: no CUDA bindings in this wheel")

    n_bad = sum(len(b.violations) for b in bins)
    if args.json:
        args.json.write_text(json.dumps({
            "binaries": [{"file": b.path.name, "kind": b.kind, "device": b.device, "target": b.target,
                          "violations": b.violations, "notes": b.notes,
                          "symbols_after_2_9": getattr(b, "symbols_after_29", []),
                          "min_runtime": getattr(b, "min_runtime", None)} for b in bins],
            "notes": notes, "violations": n_bad}, indent=1))
    print()
    if n_bad:
        print(f"SYMBOL AUDIT FAILED: {n_bad} violation(s) in "
              f"{sum(1 for b in bins if b.violations)} of {len(bins)} binaries")
        return 1
    print(f"symbol audit passed: {len(bins)} binaries "
          f"({len(kinds['binding'])} bindings, {len(kinds['kernel'])} kernel, "
          f"{len(kinds['python'])} python, {len(kinds['unknown'])} other)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

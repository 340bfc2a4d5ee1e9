"""`python -m portable_gemm vendor --into DIR --namespace NS`: copy this installed package
(loader, wrappers, every binary and the manifest) into DIR as a self-contained package whose
ops register under torch.ops.NS. Nothing is recompiled: the bindings take the namespace at
load time. The copy is written to a temporary folder and renamed into place, so an
interrupted run never leaves a half-written package.

The copy's kernel library gets a name of its own (same length, so only strings change):
the dynamic linker matches a DT_NEEDED entry against the SONAMEs already loaded, so with
one shared name a copy's bindings would bind to whichever kernel library came first (the
original's, or another copy's, possibly of another version)."""

from __future__ import annotations

import hashlib
import json
import keyword
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

from ._namespace import ORIGINAL as ORIGINAL_NAMESPACE

HERE = Path(__file__).resolve().parent
# What a vendored copy needs: Python sources, lib/ (binaries + manifest); headers and the
# CMake package are for C++ consumers of the original wheel.
SKIP = {"__pycache__", "include", "share", "_vendor.py"}
KERNELS = "libportable_gemm_kernels.so"
DT_NEEDED, DT_SONAME, DT_STRTAB, DT_STRSZ = 1, 14, 5, 10


def _check_namespace(ns: str) -> None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", ns) or keyword.iskeyword(ns):
        raise ValueError(f"namespace {ns!r} must be an ASCII Python identifier (it becomes torch.ops.{ns})")
    if ns in ("aten", "prim", "prims", "torch", "quantized", "_test"):
        raise ValueError(f"namespace {ns!r} belongs to torch; choose your project's own")
    if ns == ORIGINAL_NAMESPACE:
        raise ValueError(f"namespace {ns!r} is this package's own; a copy under it would clash with "
                         "the installed package; choose your project's own")
    taken = _torch_namespaces()
    if ns in taken:
        raise ValueError(f"namespace {ns!r} is {taken[ns]}; choose your project's own")


def _torch_namespaces() -> dict[str, str]:
    """Names torch.ops.NS cannot take in a fresh process with torch imported: torch.ops'
    own attributes (higher_order, load_library, ...) and the namespaces whose ops torch and
    its built-in libraries register at import (c10d, inductor, ...).
    Empty if torch cannot be imported here (the copy's loader then says so at import)."""
    try:
        import torch
    except ImportError:
        return {}
    attributes = set(dir(torch.ops)) | set(dir(type(torch.ops)))  # its __dir__ lists namespaces only
    taken = {name: "an attribute of torch.ops" for name in attributes if not name.startswith("__")}
    try:
        names = torch._C._dispatch_get_all_op_names()  # "ns::op" for every registered op
    except AttributeError:
        names = []
    for name in names:
        taken.setdefault(name.split("::", 1)[0], f"already registered in torch {torch.__version__}")
    return taken


def kernels_name(namespace: str, kernels_sha256: str) -> str:
    """The copy's kernel library: as long as the original's name, unique per namespace and build."""
    tag = hashlib.sha256(f"{namespace}\0{kernels_sha256}".encode()).hexdigest()
    return "libpgk" + tag[:len(KERNELS) - len("libpgk.so")] + ".so"


def _is_vendored_copy(path: Path) -> bool:
    return (path / "lib" / "manifest.json").is_file() and (path / "_namespace.py").is_file()


def vendor(into: str | os.PathLike, namespace: str, force: bool = False) -> Path:
    _check_namespace(namespace)
    dest = Path(into).resolve()
    if dest == HERE or HERE in dest.parents:  # --force would delete what is being copied
        raise ValueError(f"{dest} is inside this installed package ({HERE}); vendor into your own project")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", dest.name) or keyword.iskeyword(dest.name):
        raise ValueError(f"{dest.name!r} is not importable as a package name")
    _check_not_shadowing(dest)
    if dest.exists() or dest.is_symlink():
        if not force:
            raise FileExistsError(f"{dest} exists; pass --force to replace it")
        if dest.is_symlink() or not dest.is_dir():
            raise FileExistsError(f"{dest} exists and is not a folder; --force replaces only an earlier "
                                  "vendored copy, remove it yourself")
        if not _is_vendored_copy(dest):
            raise FileExistsError(f"{dest} exists and is not a vendored copy (no lib/manifest.json and "
                                  "_namespace.py); --force replaces only an earlier copy, remove it yourself")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(dest)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(dest), dir=dest.parent))
    old = None
    try:
        # mkdtemp makes the folder 0700: give it the mode a plain mkdir would (umask applied),
        # or other users (a container's non-root USER, a shared checkout) see an empty
        # namespace package
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for item in HERE.iterdir():
            if item.name in SKIP:
                continue
            target = tmp / item.name
            if item.is_dir():
                shutil.copytree(item, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(item, target)
        ns_file = tmp / "_namespace.py"
        text, n = re.subn(r"^NAMESPACE = .*$", f"NAMESPACE = {namespace!r}  # written by `python -m portable_gemm "
                                                f"vendor`", ns_file.read_text(), count=1, flags=re.M)
        if n != 1:
            raise RuntimeError(f"{HERE / '_namespace.py'} has no NAMESPACE line; reinstall portable_gemm")
        ns_file.write_text(text)
        manifest = _verify_copy(HERE / "lib", tmp / "lib")
        _rename_kernels(tmp, manifest, namespace)
        if dest.exists():  # an earlier copy: move it aside, put the new one in, then delete it
            old = Path(tempfile.mkdtemp(prefix=_temp_prefix(dest) + "old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not dest.exists():
            os.replace(old / dest.name, dest)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return dest


def _temp_prefix(dest: Path) -> str:
    """Work folders beside dest: hidden, named for the copy and the process that made them."""
    return f".{dest.name}.vendoring-{os.getpid()}-"


def _remove_stale_temporaries(dest: Path) -> None:
    """Delete the work folders of earlier runs for dest whose process is gone (a run killed
    by SIGKILL or SIGTERM cannot clean up; it leaves a partial copy of ~20 MB beside dest)."""
    pattern = re.compile(re.escape(f".{dest.name}.vendoring-") + r"(\d+)-")
    for path in dest.parent.iterdir():
        m = pattern.match(path.name)
        if not m or not path.is_dir() or path.is_symlink():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass  # alive (another user's) or not a pid: leave it


def _check_not_shadowing(dest: Path) -> None:
    """A top-level copy (its folder is not inside a package) must not take the name of a
    module Python can already import: from that folder, `import NAME` would get the copy."""
    if (dest.parent / "__init__.py").is_file():
        return
    if dest.name == ORIGINAL_NAMESPACE:
        raise ValueError(f"{dest} would be imported as {dest.name!r} and hide the installed portable_gemm; "
                         "vendor into a subpackage of your project (e.g. mylib/_gemm)")
    import importlib.util

    try:
        spec = importlib.util.find_spec(dest.name)
    except (ImportError, ValueError):
        return
    if spec is None:
        return
    places = [Path(p).resolve() for p in ([spec.origin] if spec.origin and spec.has_location else [])
              + list(spec.submodule_search_locations or [])]
    if any(p == dest or dest in p.parents for p in places):
        return  # dest itself (an earlier copy, or an empty folder) is what Python finds
    where = ", ".join(map(str, places)) or spec.origin or "built in"
    raise ValueError(f"{dest.name!r} is already importable ({where}); a top-level copy of that name would "
                     "hide it; choose another name or vendor into a subpackage of your project")


def _verify_copy(src: Path, dst: Path) -> dict:
    """Every binary the manifest lists matches its build sha256 (a damaged installation is not
    copied onward) and was copied whole. Returns the manifest."""
    manifest = json.loads((src / "manifest.json").read_text())
    for b in manifest["binaries"]:
        if not (src / b["file"]).is_file():
            raise RuntimeError(f"{b['file']} is missing from {src}; reinstall portable_gemm")
        digest = hashlib.sha256((src / b["file"]).read_bytes()).hexdigest()
        if digest != b.get("sha256"):
            raise RuntimeError(f"{b['file']} does not match the manifest's sha256; reinstall portable_gemm")
        if hashlib.sha256((dst / b["file"]).read_bytes()).hexdigest() != digest:
            raise RuntimeError(f"copying {b['file']} produced a different file; check the destination disk")
    return manifest


def _rename_kernels(pkg: Path, manifest: dict, namespace: str) -> None:
    """Give the copy in pkg its own kernel library: rename the file, rewrite its SONAME and
    every DT_NEEDED naming it (bindings in lib/, the DLPack module), then the manifest's file
    name and sha256s."""
    lib = pkg / "lib"
    entry = next(b for b in manifest["binaries"] if b.get("kind") == "kernels")
    if entry["file"] != KERNELS:
        raise RuntimeError(f"the manifest names the kernel library {entry['file']!r}, not {KERNELS!r}: "
                           "vendor from the original wheel, not from a vendored copy")
    new = kernels_name(namespace, entry["sha256"])
    patched = {KERNELS: rename_dynamic_strings(lib / KERNELS, KERNELS, new, DT_SONAME)}
    os.replace(lib / KERNELS, lib / new)
    for b in manifest["binaries"]:
        if b.get("kind") == "binding":
            patched[b["file"]] = rename_dynamic_strings(lib / b["file"], KERNELS, new, DT_NEEDED)
    for ext in pkg.glob("_dlpack*.so"):
        patched[ext.name] = rename_dynamic_strings(ext, KERNELS, new, DT_NEEDED)
    missing = [f for f, n in patched.items() if n == 0]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} do not name {KERNELS} in their dynamic section; "
                           "this build cannot be vendored")
    entry["file"] = new
    for b in manifest["binaries"]:
        b["sha256"] = hashlib.sha256((lib / b["file"]).read_bytes()).hexdigest()
    manifest["vendored"] = {"namespace": namespace, "kernels_renamed_from": KERNELS}
    (lib / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def dynamic_strings(path: Path) -> list[tuple[int, str, int]]:
    """(tag, string, file offset of the string) for each DT_NEEDED and DT_SONAME entry of a
    64-bit little-endian ELF file, read through PT_DYNAMIC and DT_STRTAB."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise RuntimeError(f"{path.name} is not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        raise RuntimeError(f"{path.name} has no dynamic section")
    entries = []
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        entries.append((tag, val))
    strtab_vaddr = next(v for t, v in entries if t == DT_STRTAB)
    strsz = next(v for t, v in entries if t == DT_STRSZ)
    strtab = next((o + strtab_vaddr - v for v, o, n in loads if v <= strtab_vaddr < v + n), None)
    if strtab is None:
        raise RuntimeError(f"{path.name}: its dynamic string table lies outside its loaded segments")
    out = []
    for tag, val in entries:
        if tag in (DT_NEEDED, DT_SONAME):
            if val >= strsz:
                raise RuntimeError(f"{path.name}: a dynamic entry points past its string table")
            start = strtab + val
            end = data.index(b"\0", start)
            out.append((tag, data[start:end].decode(), start))
    return out


def rename_dynamic_strings(path: Path, old: str, new: str, tag: int) -> int:
    """Rewrite, in place, each `tag` entry (DT_NEEDED or DT_SONAME) naming old to name new
    (same length: only bytes of the string table change). Returns how many were rewritten."""
    if len(new) != len(old):
        raise ValueError(f"{new!r} must be as long as {old!r}")
    hits = [off for t, s, off in dynamic_strings(path) if t == tag and s == old]
    if hits:
        with open(path, "r+b") as f:
            for off in hits:
                f.seek(off)
                f.write(new.encode())
    return len(hits)

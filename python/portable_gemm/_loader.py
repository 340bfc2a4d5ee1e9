"""Load the binding library that matches the installed torch and register its ops.

The manifest written at build time (lib/manifest.json) is the only list of binaries the
loader trusts. `select_variant` decides; this module dlopens (RTLD_NOW, so a missing symbol
is an error here, not a crash later), checks the library reports the target it was meant to
be, and registers the ops under this copy's namespace.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import _env
from ._namespace import NAMESPACE, VENDORED, WHO
from ._variant import Candidate, Selection, parse_version, select_variant

LIB_DIR = Path(__file__).resolve().parent / "lib"
ENV_TARGET = "PORTABLE_GEMM_TARGET"
KERNELS_FILE = "libportable_gemm_kernels.so"  # when the manifest names no kernel library


def _reinstall() -> str:
    """What to do about a damaged install, for error messages (only built on those paths:
    reading the installed metadata takes tens of milliseconds)."""
    if VENDORED:
        return (f"re-vendor the copy (python -m portable_gemm vendor --into {LIB_DIR.parent} --namespace "
                f"{NAMESPACE} --force) or reinstall the package that ships {__package__.split('.')[0]}")
    from importlib import metadata

    try:  # this very release; --no-deps keeps the installed torch (pip would replace it)
        pin = f"portable-gemm=={metadata.version('portable-gemm')}"
    except metadata.PackageNotFoundError:
        pin = "portable-gemm"
    return (f"reinstall the wheel (pip install --force-reinstall --no-deps with the wheel file you installed, "
            f"or {pin} from your package index; --no-deps keeps the installed torch)")


@dataclass
class LoadState:
    namespace: str
    torch_version: str
    selection: Selection
    target: str | None = None
    manifest: dict = field(default_factory=dict)
    libraries: dict[str, str] = field(default_factory=dict)
    features: dict = field(default_factory=dict)
    cuda_loaded: bool = False
    cuda_reason: str = ""
    candidates: list[Candidate] = field(default_factory=list)
    cpu_binding: object = None  # the loaded CPU _Binding: info() asks it for the threading now


def read_manifest(lib_dir: Path = LIB_DIR) -> dict:
    path = lib_dir / "manifest.json"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ImportError(f"{WHO}: {path} is missing; the installation is incomplete "
                          f"({_reinstall()})") from None
    except (OSError, ValueError) as e:
        raise ImportError(f"{WHO}: cannot read {path}: {e} ({_reinstall()})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("binaries"), list):
        raise ImportError(f"{WHO}: {path} lists no binaries ({_reinstall()})")
    return manifest


def check_library_file(path: Path, sha256: str | None = None) -> None:
    """Refuse a damaged shared object before dlopen sees it: dlopen maps segments past the
    end of a truncated file and the first touch kills the process with SIGBUS. Checks the
    sha256 first when the manifest gives one (bindings are small; hashing them costs < 1 ms),
    then that the ELF header is sane and its program headers and every PT_LOAD segment lie
    inside the file (a manifest may also lie consistently). Every failure is an OSError,
    which the loader's fallback handles."""
    if not path.is_file():
        raise OSError(f"{path.name} is missing from {path.parent}")
    if sha256:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != sha256:
            problem = _elf_problem(path)
            raise OSError(f"{path.name} differs from the build manifest (sha256 {digest[:12]}… != "
                          f"{sha256[:12]}…): " + (f"it {problem}" if problem else "damaged or replaced"))
    problem = _elf_problem(path)
    if problem:
        raise OSError(f"{path.name} {problem}")


def _elf_problem(path: Path) -> str | None:
    """What is wrong with the file's ELF header or extent, or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return "is not a 64-bit little-endian ELF shared object (damaged?)"
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            if phentsize != 56:  # sizeof(Elf64_Phdr)
                return f"has a damaged ELF header (program header size {phentsize}, not 56)"
            if phoff + phentsize * phnum > size:
                return f"is truncated ({size} bytes; its program headers end beyond that)"
            f.seek(phoff)
            table = f.read(phentsize * phnum)
        for i in range(phnum):
            p_type, _, p_offset = struct.unpack_from("<IIQ", table, i * phentsize)
            p_filesz, = struct.unpack_from("<Q", table, i * phentsize + 32)
            if p_type == 1 and p_offset + p_filesz > size:  # PT_LOAD
                return f"is truncated ({size} bytes; a segment ends at {p_offset + p_filesz})"
    except struct.error as e:
        return f"has a damaged ELF header ({e})"
    return None


def _bindings(manifest: dict, device: str) -> dict[str, dict]:
    return {b["target"]: b for b in manifest["binaries"]
            if isinstance(b, dict) and b.get("kind") == "binding" and b.get("device") == device
            and isinstance(b.get("target"), str)}


class _Binding:
    """One dlopen'ed binding library and its C entry points."""

    def __init__(self, path: Path, sha256: str | None = None):
        check_library_file(path, sha256)
        self.path = path
        self.lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        try:
            self._register = self.lib.portable_gemm_register
            info_fn = self.lib.portable_gemm_binding_info
        except AttributeError:
            raise OSError(f"{path.name} is not a portable_gemm binding (no entry points)") from None
        self._register.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        self._register.restype = ctypes.c_int
        info_fn.restype = ctypes.c_char_p
        self._info_fn = info_fn
        self.info = self.current_info()

    def current_info(self) -> dict:
        """The binding's info as of now (its CPU threading can change in a forked child)."""
        return json.loads(self._info_fn().decode())

    def register(self, namespace: str) -> None:
        err = ctypes.create_string_buffer(1024)
        rc = self._register(namespace.encode(), err, len(err))
        if rc == 2:
            raise NamespaceTaken(namespace)
        if rc != 0:
            raise OSError(f"{self.path.name}: registering torch.ops.{namespace} failed: "
                          f"{err.value.decode(errors='replace')}")


class NamespaceTaken(OSError):
    """torch.ops.NS is defined already in this process: no target of this package can load."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        super().__init__(f"torch.ops.{namespace} is already defined in this process")


def _namespace_owner(namespace: str) -> str | None:
    """The other imported package (the original or a vendored copy) whose namespace it is."""
    ours = sys.modules.get(f"{__package__}._namespace")
    for name, mod in list(sys.modules.items()):
        if (name.endswith("._namespace") and mod is not None and mod is not ours
                and getattr(mod, "NAMESPACE", None) == namespace):
            return name.rpartition(".")[0]
    return None


def _namespace_taken_error(namespace: str) -> ImportError:
    owner = _namespace_owner(namespace)
    by = f"by the package {owner}" if owner else "by another library"
    fix = (f"vendor this copy under a namespace of its own (python -m portable_gemm vendor --into "
           f"{LIB_DIR.parent} --namespace OTHER_NAME --force)" if VENDORED else
           "one process can load one portable_gemm package; vendored copies take namespaces of their own")
    return ImportError(f"{WHO}: torch.ops.{namespace} is already defined in this process, {by}; two packages "
                       f"cannot register one namespace: {fix}")


def _load_binding(entry: dict, lib_dir: Path, expect_target: str, namespace: str) -> _Binding:
    if not isinstance(entry.get("file"), str):
        raise OSError(f"the manifest's entry for target {expect_target} names no file")
    binding = _Binding(lib_dir / entry["file"], entry.get("sha256"))
    got = binding.info.get("target")
    if got != expect_target:
        raise OSError(f"{entry['file']} reports target {got}, but the manifest says {expect_target}")
    binding.register(namespace)
    return binding


def _kernels_file(manifest: dict) -> str:
    """The kernel library's file: the manifest's binaries entry of kind "kernels" (a vendored
    copy may name its own), else the wheel's usual name."""
    return next((b["file"] for b in manifest["binaries"]
                 if isinstance(b, dict) and b.get("kind") == "kernels" and isinstance(b.get("file"), str)),
                KERNELS_FILE)


def load(namespace: str = NAMESPACE, lib_dir: Path = LIB_DIR) -> LoadState:
    manifest = read_manifest(lib_dir)
    cpu = _bindings(manifest, "cpu")
    forced = os.environ.get(ENV_TARGET)
    try:
        parse_version(torch.__version__)
    except (ValueError, TypeError) as e:  # a torch build that rewrote its version
        raise ImportError(f"{WHO}: cannot read the installed torch's version ({e}), so no target can be "
                          f"chosen for it; torch is at {os.path.dirname(torch.__file__)}") from None
    try:
        selection = select_variant(torch.__version__, list(cpu), forced,
                                   minimum=manifest.get("minimum_torch", "2.9"))
    except (ValueError, TypeError) as e:
        raise ImportError(f"{WHO}: {lib_dir / 'manifest.json'} holds a version that cannot be "
                          f"read: {e} ({_reinstall()})") from None
    if selection.error:
        raise ImportError(f"{WHO}: {selection.error}\ncandidates:\n{selection.explain()}")

    state = LoadState(namespace, torch.__version__, selection, manifest=manifest)
    kernels = lib_dir / _kernels_file(manifest)
    try:
        check_library_file(kernels)
    except OSError as e:
        raise ImportError(f"{WHO}: the kernel library cannot be used: {e} ({_reinstall()})") from None
    # The selected target first; if its binary cannot load, fall back to older eligible
    # ones (never when a target was forced: the user asked for that one).
    order = [c for c in selection.candidates if c.status == "selected"]
    if not (forced and forced.strip()):
        order += [c for c in selection.candidates if c.status == "eligible"]
    failures: dict[str, str] = {}
    binding = None
    for cand in order:
        try:
            binding = _load_binding(cpu[cand.target], lib_dir, cand.target, namespace)
        except NamespaceTaken:  # no other target could register either: no fallback
            raise _namespace_taken_error(namespace) from None
        except OSError as e:
            failures[cand.target] = str(e)
            continue
        state.target = cand.target
        break

    fallback = "; ".join(f"{t} failed to load ({e})" for t, e in failures.items())
    fell_back = bool(failures) and state.target is not None
    for c in selection.candidates:
        if c.target in failures:
            state.candidates.append(Candidate(c.target, "rejected", f"failed to load: {failures[c.target]}"))
        elif c.target == state.target:
            state.candidates.append(Candidate(c.target, "loaded", f"fallback: {fallback}" if fell_back else c.reason))
        elif fell_back and c.status == "eligible":
            state.candidates.append(Candidate(c.target, "eligible", f"runs on torch {torch.__version__}, "
                                                                    f"but {state.target} was loaded"))
        elif c.status == "selected":
            state.candidates.append(Candidate(c.target, "eligible", c.reason))
        else:
            state.candidates.append(c)
    if binding is None:
        lines = "\n".join(f"  {c.target}: {c.status} - {c.reason}" for c in state.candidates)
        raise ImportError(f"{WHO}: no binding could be loaded for torch {torch.__version__}; "
                          f"{_reinstall()}\ncandidates:\n{lines}")
    if fell_back:
        _env.warn_all([f"{fallback}; loaded target {state.target} instead ({_reinstall()})"])

    state.libraries["kernels"] = str(kernels)
    state.libraries["cpu"] = str(binding.path)
    state.cpu_binding = binding
    target_features = next((t["features"] for t in manifest.get("matrix_targets", [])
                            if t["version"] == state.target), {})
    state.features = {**target_features, "threading": binding.info.get("threading"),
                      "threading_why": binding.info.get("threading_why"),
                      "cpu_isa": binding.info.get("cpu_isa")}
    if binding.info.get("cpu_avx2_dq"):  # the AVX2 kernels' dequantise-once rows (empty elsewhere)
        state.features["cpu_avx2_dq"] = binding.info["cpu_avx2_dq"]
    _env.warn_all(_env.problems(os.environ, cpu_isa=state.features["cpu_isa"], target=state.target,
                                threading=state.features["threading"],
                                threading_why=state.features["threading_why"]))
    _load_cuda(state, lib_dir, namespace)
    return state


def _load_cuda(state: LoadState, lib_dir: Path, namespace: str) -> None:
    if torch.version.cuda is None:
        state.cuda_reason = f"torch {torch.__version__} is a CPU-only build; CUDA binding not tried"
        state.features.pop("stream_api", None)
        state.features.pop("cuda_error_check", None)
        return
    entry = _bindings(state.manifest, "cuda").get(state.target)
    if entry is None:
        state.cuda_reason = f"this wheel has no CUDA binding for target {state.target} (built without nvcc)"
        return
    try:
        binding = _load_binding(entry, lib_dir, state.target, namespace)
    except OSError as e:
        state.cuda_reason = f"CUDA binding for target {state.target} failed to load: {e}; CPU ops still work"
        return
    state.cuda_loaded = True
    # (No torch.cuda.is_available() here: it would initialise the driver on every import.)
    state.cuda_reason = f"binding for target {state.target}, torch CUDA {torch.version.cuda}"
    state.libraries["cuda"] = str(binding.path)
    state.features.update({k: binding.info[k] for k in ("stream_api", "cuda_error_check")})

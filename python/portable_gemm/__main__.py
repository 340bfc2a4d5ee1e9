"""Command line: `python -m portable_gemm {info,demo,vendor}` and `--cmake-dir`.

Everything here imports this package relatively (`__package__`), so a vendored copy's
`python -m mylib._gemm info` describes the copy, not an installed portable_gemm."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# The package this file belongs to: "portable_gemm", or a vendored copy's name.
PACKAGE = __package__ or "portable_gemm"


def _is_vendored() -> bool:
    """Whether this is a copy made by `python -m portable_gemm vendor` (its own namespace)."""
    return importlib.import_module(f"{PACKAGE}._namespace").VENDORED


def _loaded():
    """The package with its binding loaded, or None after printing the loader's refusal (one
    message naming every candidate and why it was rejected) without a traceback."""
    try:
        pg = importlib.import_module(PACKAGE)  # loads the binding here if torch is imported
        pg.info  # noqa: B018  (otherwise the first torch-facing name does)
    except ImportError as e:
        print(e, file=sys.stderr)  # the loader's messages start with the package's name
        return None
    return pg


def _demo(pg, devices: list[str]) -> int:
    import torch

    format_info = importlib.import_module(f"{PACKAGE}._info").format_info

    print(format_info(pg.info()))
    print()
    torch.manual_seed(0)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
    rows = []
    failed = 0

    def check(name, device, out, ref, rtol, t):
        nonlocal failed
        err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        ok = err <= rtol
        failed += not ok
        rows.append((name, device, tuple(out.shape), f"{err:.2e}", f"{rtol:.0e}", f"{t * 1e3:.2f}", "ok" if ok else "FAIL"))

    for device in devices:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            a = torch.randn(257, 512, dtype=dtype, device=device)
            b = torch.randn(512, 384, dtype=dtype, device=device)
            bias = torch.randn(384, dtype=dtype, device=device)
            pg.gemm(a, b, bias=bias, activation="gelu")  # warm-up
            t0 = time.perf_counter()
            out = pg.gemm(a, b, bias=bias, activation="gelu")
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter() - t0
            ref = torch.nn.functional.gelu(a.double() @ b.double() + bias.double())
            check(f"gemm {str(dtype)[6:]} +bias gelu", device, out, ref, tol[dtype], t)
        # quantize_weight against the weight itself (mixed_linear's reference below is built
        # from q and s, so a quantiser that lost the weight would pass there): symmetric
        # rounding of Gaussian weights leaves ~0.8 % (int8 per channel) / ~12 % (int4 g128)
        for bits, group, qtol in ((8, None, 2e-2), (4, 128, 2e-1)):
            w = torch.randn(1024, 2048, dtype=torch.bfloat16, device=device)
            t0 = time.perf_counter()
            q, s = pg.quantize_weight(w, bits=bits, group_size=group)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter() - t0
            check(f"quantize_weight int{bits} g{group or 'chan'}", device,
                  pg.dequantize_weight(q, s, bits=bits, group_size=group, dtype=torch.float64), w.double(), qtol, t)
            x = torch.randn(16, 2048, dtype=torch.bfloat16, device=device)
            pg.mixed_linear(x, q, s, bits=bits, group_size=group)
            t0 = time.perf_counter()
            out = pg.mixed_linear(x, q, s, bits=bits, group_size=group)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter() - t0
            wd = pg.dequantize_weight(q, s, bits=bits, group_size=group, dtype=torch.float64)
            ref = x.double() @ wd.T
            check(f"mixed_linear int{bits} g{group or 'chan'}", device, out, ref, 2e-2, t)

    head = ("op", "device", "shape", "rel.err", "tol", "ms", "")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}")
    parser.add_argument("--cmake-dir", action="store_true",
                        help="print the folder of the CMake package config (for find_package)")
    sub = parser.add_subparsers(dest="cmd")
    p_info = sub.add_parser("info", help="which binary was loaded and why")
    p_info.add_argument("--json", action="store_true", help="print info() as JSON")
    p_demo = sub.add_parser("demo", help="print info, run every op against a float64 reference")
    p_demo.add_argument("--device", action="append", choices=["cpu", "cuda"],
                        help="devices to run on (default: cpu, plus cuda when available)")
    p_vendor = sub.add_parser("vendor", help="copy this package into DIR, registering its ops under torch.ops.NS")
    p_vendor.add_argument("--into", required=True, help="destination package folder (its name is the import name)")
    p_vendor.add_argument("--namespace", required=True, help="torch.ops namespace of the copy")
    p_vendor.add_argument("--force", action="store_true", help="replace DIR if it exists")
    args = parser.parse_args(argv)

    if args.cmake_dir:
        cmake_dir = os.path.join(HERE, "share", "cmake", "PortableGemm")
        if not os.path.isdir(cmake_dir):
            print(f"--cmake-dir: {PACKAGE} has no CMake package ({cmake_dir} does not exist); "
                  + ("a vendored copy carries none: C++ consumers build against the portable_gemm wheel's"
                     if _is_vendored() else "reinstall portable_gemm"), file=sys.stderr)
            return 2
        print(cmake_dir)
        return 0
    if args.cmd == "info":
        pg = _loaded()
        if pg is None:
            return 1
        d = pg.info()
        format_info = importlib.import_module(f"{PACKAGE}._info").format_info
        print(json.dumps(d, indent=2) if args.json else format_info(d))
        return 0
    if args.cmd == "vendor":
        if _is_vendored():
            print(f"vendor: {PACKAGE} is a vendored copy; vendor from the installed portable_gemm "
                  "(python -m portable_gemm vendor ...)", file=sys.stderr)
            return 2
        vendor = importlib.import_module(f"{PACKAGE}._vendor").vendor

        try:
            dest = vendor(args.into, args.namespace, force=args.force)
        except (ValueError, OSError, RuntimeError) as e:  # OSError: FileExistsError, a full disk, ...
            print(f"vendor: {e}", file=sys.stderr)
            return 2
        if (dest.parent / "__init__.py").is_file():
            how = f"import it as {dest.parent.name}.{dest.name} (a subpackage of {dest.parent})"
        else:
            how = (f"import it as {dest.name} with {dest.parent} on sys.path, or add {dest.parent / '__init__.py'} "
                   f"to import it as {dest.parent.name}.{dest.name}")
        print(f"vendored portable_gemm into {dest} (torch.ops.{args.namespace}); {how}")
        d = dest.name
        print(f"to ship it in your wheel: package data {d}/*.so, {d}/lib/*.so, {d}/lib/manifest.json, "
              f"{d}/licenses/* and {d}/licenses/LICENSES/* (the notices its binaries must travel with), "
              "a platform wheel, torch>=2.9 among your dependencies (README, 'Shipping a vendored copy')")
        return 0
    if args.cmd == "demo":
        import torch

        if "cuda" in (args.device or []) and not torch.cuda.is_available():
            why = ("this torch is a CPU-only build" if not torch.version.cuda
                   else f"torch {torch.__version__} finds no CUDA device")
            print(f"demo: --device cuda asked for, but {why}", file=sys.stderr)
            return 2
        pg = _loaded()
        if pg is None:
            return 1
        cuda = pg.info()["cuda"]
        if "cuda" in (args.device or []) and not cuda["loaded"]:
            print(f"demo: --device cuda asked for, but the CUDA binding is not loaded: {cuda['reason']}",
                  file=sys.stderr)
            return 2
        devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() and cuda["loaded"] else []))
        if args.device is None and torch.cuda.is_available() and not cuda["loaded"]:
            print(f"demo: a CUDA device is present, but the CUDA binding is not loaded ({cuda['reason']}); "
                  "the demo runs on the CPU only", file=sys.stderr)
        return _demo(pg, devices)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

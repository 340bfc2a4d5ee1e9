"""Install-time step: add each binary's sha256 to the build manifest and write it beside
the binaries (portable_gemm/lib/manifest.json). Fails if a listed binary is missing."""

import hashlib
import json
import os
import sys


def main(template: str, libdir: str) -> None:
    with open(template) as f:
        manifest = json.load(f)
    for entry in manifest["binaries"]:
        path = os.path.join(libdir, entry["file"])
        if not os.path.isfile(path):
            sys.exit(f"write_manifest: {entry['file']} was not installed into {libdir}")
        with open(path, "rb") as f:
            entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
    tmp = os.path.join(libdir, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, os.path.join(libdir, "manifest.json"))  # never a half-written manifest
    print(f"-- portable_gemm: wrote manifest.json ({len(manifest['binaries'])} binaries)")


if __name__ == "__main__":
    main(*sys.argv[1:3])

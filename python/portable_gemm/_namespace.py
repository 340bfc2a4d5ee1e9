"""The torch.ops namespace this copy registers under. `python -m portable_gemm vendor`
rewrites the NAMESPACE line in the vendored copy; nothing else names the namespace."""

NAMESPACE = "portable_gemm"
ORIGINAL = "portable_gemm"  # the package's own namespace, which no vendored copy may take
VENDORED = NAMESPACE != ORIGINAL
# How messages (import errors, warnings) name this package: a copy names itself, so that a
# user with several copies in one process can tell which one is speaking.
WHO = f"{__package__} (portable_gemm vendored as torch.ops.{NAMESPACE})" if VENDORED else "portable_gemm"

"""The torch.ops namespace this copy registers under. `python -m portable_gemm vendor`
rewrites this one line in the vendored copy; nothing else names the namespace."""

NAMESPACE = "portable_gemm"

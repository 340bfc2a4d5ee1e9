// The one place that names torch versions. Every compat header branches on these, never
// on raw numbers. There is no TORCH_VERSION_2_9_0 in torch's headers: "2.9" is simply
// "below 2.10" (and -Werror=undef turns a misspelt macro into a build error).
#pragma once
#include <torch/csrc/stable/version.h>

#ifndef TORCH_TARGET_VERSION
#error "bindings are compiled per target: pass -DTORCH_TARGET_VERSION=<hex> (see cmake/PortableGemmTorch.cmake)"
#endif

#define PG_TARGET_AT_LEAST_2_10 (TORCH_TARGET_VERSION >= TORCH_VERSION_2_10_0)
#define PG_TARGET_AT_LEAST_2_13 (TORCH_TARGET_VERSION >= TORCH_VERSION_2_13_0)

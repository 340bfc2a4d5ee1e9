// Op registration under a namespace chosen at load time (so a vendored copy can live
// beside the real package). STABLE_TORCH_LIBRARY bakes the namespace in at compile time
// and ignores the init status, so we drive the same C API directly: every call checked.
// 2.10 added torch_library_impl, which records the extension's ABI version.
#pragma once
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <stdexcept>
#include <string>
#include "compat/version.h"

namespace portable_gemm::compat {

using BoxedKernel = void (*)(StableIValue*, uint64_t, uint64_t);

// torch refused to define the namespace's library: it is defined already (another copy of
// portable_gemm, or another library, registered it in this process). The loader reports it
// as such instead of trying older targets.
struct NamespaceTaken : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Owns nothing: registrations live as long as the process (deleting the handle would
// unregister ops that Python code may still hold).
class Library {
 public:
  static Library def(const char* ns) { return Library(ns, nullptr); }
  static Library impl(const char* ns, const char* dispatch_key) { return Library(ns, dispatch_key); }

  Library& define(const char* schema) {
    check(aoti_torch_library_def(handle_, schema), "define", schema);
    return *this;
  }
  Library& kernel(const char* name, BoxedKernel fn) {
#if PG_TARGET_AT_LEAST_2_10
    check(torch_library_impl(handle_, name, fn, TORCH_ABI_VERSION), "impl", name);
#else
    check(aoti_torch_library_impl(handle_, name, fn), "impl", name);
#endif
    return *this;
  }

 private:
  Library(const char* ns, const char* key) {
    AOTITorchError err = key ? aoti_torch_library_init_impl(ns, key, __FILE__, __LINE__, &handle_)
                             : aoti_torch_library_init_def(ns, __FILE__, __LINE__, &handle_);
    if (err != AOTI_TORCH_SUCCESS && !key)
      throw NamespaceTaken(std::string("torch refused to define library '") + ns +
                           "': the namespace is already defined in this process");
    check(err, "open impl library for", ns);
  }
  static void check(AOTITorchError err, const char* what, const char* name) {
    if (err != AOTI_TORCH_SUCCESS)
      throw std::runtime_error(std::string("torch refused to ") + what + " '" + name +
                               "' (already registered by another copy of portable_gemm?)");
  }
  TorchLibraryHandle handle_ = nullptr;
};

}  // namespace portable_gemm::compat

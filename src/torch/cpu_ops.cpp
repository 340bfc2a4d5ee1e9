// CPU binding, compiled once per torch target. Defines the schemas and the CPU kernels.
#include <cstring>
#include <string>

#include "compat/threading.h"
#include "ops_common.h"

namespace portable_gemm::binding {
namespace {

struct CpuBackend {
  static constexpr const char* dispatch_key = "CPU";
  static void check_device(const Tensor& t, const char* op) {
    PG_CHECK(t.is_cpu(), op, ": the CPU kernel got a non-CPU tensor");
  }
  // gemm's and mixed_linear's outputs are new (add_epilogue_and_output) and written in
  // full: large ones are offered huge pages before their first touch
  // (cpu::advise_new_output). quantize_weight's are not: weights on huge pages read no
  // faster on the Xeon VM (0.97-1.06x the time at M = 1, bench/CPU_NOTES.md 64).
  static void advise(const Matrix& out) {
    cpu::advise_new_output(out.data, size_t(out.rows * out.cols) * dtype_size(out.dtype));
  }
  // PORTABLE_GEMM_FILL_OUTPUTS=1 (the tests): the outputs NaN / 0xFF before the kernel runs
  // (after the huge-page advice, which must come before the first touch).
  template <class Args>
  static void fill(const Args& a) {
    if (fill_new_outputs())
      for (const Span& s : fresh_outputs(a))
        if (s.bytes != 0) std::memset(s.data, 0xFF, s.bytes);  // an empty output's data may be null
  }
  static void run(const GemmArgs& a, const Tensor&, const char* op) {
    advise(a.c);
    fill(a);
    throw_if_error(cpu::gemm(a, compat::cpu_executor()), op);
  }
  static void run(const MixedLinearArgs& a, const Tensor&, const char* op) {
    advise(a.y);
    fill(a);
    throw_if_error(cpu::mixed_linear(a, compat::cpu_executor()), op);
  }
  static void run(const QuantizeArgs& a, const Tensor&, const char* op) {
    fill(a);
    throw_if_error(cpu::quantize(a, compat::cpu_executor()), op);
  }
};

}  // namespace
}  // namespace portable_gemm::binding

PG_BINDING_EXPORT int portable_gemm_register(const char* ns, char* err, size_t errlen) {
  using namespace portable_gemm::binding;
  return register_namespace<CpuBackend>(ns, /*define=*/true, err, errlen);
}

// The threading fields say what runs our CPU ops when asked: target 2.9 leaves torch's
// OpenMP runtime in a child forked after the import (compat/torch_openmp.h).
PG_BINDING_EXPORT const char* portable_gemm_binding_info() {
  namespace compat = portable_gemm::compat;
  auto make = [] {
    return std::string("{\"target\": \"") + PG_TARGET_VERSION +
           "\", \"device\": \"cpu\", \"threading\": \"" + compat::cpu_executor_name() +
           "\", \"threading_why\": \"" + compat::cpu_executor_why() +
           "\", \"cpu_isa\": \"" + portable_gemm::cpu::isa() +
           "\", \"cpu_avx2_dq\": \"" + portable_gemm::cpu::avx2_dq_path() +
           "\", \"fill_outputs\": " + (portable_gemm::fill_new_outputs() ? "true" : "false") + "}";
  };
  static const std::string info = make();
  if (std::strcmp(compat::cpu_executor_name(), compat::cpu_executor().name) != 0) {
    static const std::string in_child = make();
    return in_child.c_str();
  }
  return info.c_str();
}

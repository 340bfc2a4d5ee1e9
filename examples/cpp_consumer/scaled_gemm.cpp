// mylib::scaled_gemm(a, b, alpha) = alpha * (a @ b) for 2-D float32 CPU tensors, built on
// portable_gemm's kernel library (threads from torch's pool via the stable parallel_for).
#include <portable_gemm/kernels.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

using torch::stable::Tensor;

namespace {

portable_gemm::Executor torch_executor() {
  portable_gemm::Executor e;
  e.parallel_for = [](void*, int64_t b, int64_t end, int64_t grain, portable_gemm::Executor::Body body,
                      void* ctx) {
    torch::stable::parallel_for(b, end, grain, [&](int64_t x, int64_t y) { body(ctx, x, y); });
  };
  e.num_threads = [](void*) { return static_cast<int>(torch::stable::get_num_threads()); };
  return e;
}

Tensor scaled_gemm(Tensor a, Tensor b, double alpha) {
  STD_TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "scaled_gemm: need [M,K] @ [K,N]");
  STD_TORCH_CHECK(a.scalar_type() == torch::headeronly::ScalarType::Float &&
                      b.scalar_type() == torch::headeronly::ScalarType::Float,
                  "scaled_gemm: float32 only");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  Tensor out = torch::stable::empty({M, N}, torch::headeronly::ScalarType::Float, std::nullopt, a.device());
  portable_gemm::GemmArgs args;
  args.a = {a.const_data_ptr(), M, K, a.stride(0), a.stride(1), portable_gemm::DType::f32};
  args.b = {b.const_data_ptr(), K, N, b.stride(0), b.stride(1), portable_gemm::DType::f32};
  args.c = {out.mutable_data_ptr(), M, N, N > 0 ? N : 1, 1, portable_gemm::DType::f32};
  auto status = portable_gemm::cpu::gemm(args, torch_executor());
  STD_TORCH_CHECK(status.ok(), "scaled_gemm: ", status.message);
  float* p = static_cast<float*>(out.mutable_data_ptr());
  for (int64_t i = 0; i < M * N; ++i) p[i] *= static_cast<float>(alpha);
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY(mylib, m) { m.def("scaled_gemm(Tensor a, Tensor b, float alpha) -> Tensor"); }
STABLE_TORCH_LIBRARY_IMPL(mylib, CPU, m) { m.impl("scaled_gemm", TORCH_BOX(&scaled_gemm)); }

// Runs an AOTInductor package whose model calls portable_gemm's ops, from C++ without Python
// (CPU packages: the input is made on the CPU and only libtorch_cpu is linked).
//
//   run_package BINDING PACKAGE IN OUT ROWS COLS
//
// BINDING is the portable_gemm binding for the libtorch this program runs against: the
// newest target not newer than it (portable_gemm_cpu_t2_13.so for libtorch 2.13; `python -m
// portable_gemm info` prints the one its loader picks). Its RUNPATH finds the kernel library
// next to it. portable_gemm_register() defines the ops under a namespace, which must be the
// one the package was exported with ("portable_gemm" unless the package was vendored).
// IN holds ROWS x COLS bf16 values (raw, row-major); OUT receives the model's first output,
// raw, in its own dtype. Exit codes: 2 usage, 3 dlopen, 4 registration, 5 input, 6 output,
// 7 an exception from torch (loading or running the package).
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

template <typename Fn>
Fn symbol(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (!p) std::cerr << "dlsym " << name << ": " << dlerror() << "\n";
  return reinterpret_cast<Fn>(p);
}

int run(int argc, char** argv) {
  if (argc != 7) {
    std::cerr << "usage: run_package BINDING PACKAGE IN OUT ROWS COLS\n";
    return 2;
  }
  void* binding = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!binding) {
    std::cerr << "dlopen: " << dlerror() << "\n";
    return 3;
  }
  using Register = int (*)(const char* ns, char* err, size_t errlen);
  using Info = const char* (*)();
  auto reg = symbol<Register>(binding, "portable_gemm_register");
  auto info = symbol<Info>(binding, "portable_gemm_binding_info");
  if (!reg || !info) return 4;
  char err[1024] = {0};
  if (reg("portable_gemm", err, sizeof err) != 0) {
    std::cerr << "portable_gemm_register: " << err << "\n";
    return 4;
  }
  std::cout << "binding " << info() << "\n";

  const int64_t rows = std::stoll(argv[5]), cols = std::stoll(argv[6]);
  std::ifstream in(argv[3], std::ios::binary);
  if (!in) {
    std::cerr << "IN: cannot open " << argv[3] << "\n";
    return 5;
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (static_cast<int64_t>(bytes.size()) != rows * cols * 2) {
    std::cerr << "IN: read " << bytes.size() << " bytes, expected " << rows * cols * 2 << "\n";
    return 5;
  }
  at::Tensor x = at::from_blob(bytes.data(), {rows, cols}, at::kBFloat16).clone();

  torch::inductor::AOTIModelPackageLoader loader(argv[2]);
  std::vector<at::Tensor> outputs = loader.run({x});
  at::Tensor y = outputs.at(0).contiguous();
  std::cout << "output " << y.sizes() << " " << y.scalar_type() << "\n";
  std::ofstream out(argv[4], std::ios::binary);
  out.write(static_cast<const char*>(y.data_ptr()), static_cast<std::streamsize>(y.nbytes()));
  out.close();
  if (out.fail()) {
    std::cerr << "OUT: write failed\n";
    return 6;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 7;
  }
}

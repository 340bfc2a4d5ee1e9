// Runs an AOTInductor package whose model calls portable_gemm's ops, from C++ without Python.
//
//   run_package [--namespace NS] PACKAGE IN OUT ROWS COLS CPU_BINDING [CUDA_BINDING]
//
// CPU_BINDING is the portable_gemm binding for the libtorch this program runs against: the
// newest target not newer than it (portable_gemm_cpu_t2_13.so for libtorch 2.13; `python -m
// portable_gemm info` prints the ones its loader picks). Its RUNPATH finds the kernel library
// next to it. Its portable_gemm_register() defines the ops under the namespace NS, which must
// be the one the package was exported with: "portable_gemm" (the default), or a vendored
// copy's own (`python -m portable_gemm vendor --into DIR --namespace NS`; pass the copy's
// bindings then, from its lib folder).
// A CUDA package also needs CUDA_BINDING (portable_gemm_cuda_t2_11.so and so on, the same
// target), whose portable_gemm_register() adds the CUDA kernels to those ops; the program
// must then be linked with libtorch_cuda (CMakeLists.txt does where torch has it), and the
// input is moved to the current CUDA device.
// IN holds ROWS x COLS bf16 values (raw, row-major); OUT receives the model's first output,
// raw, in its own dtype, copied to the CPU. Exit codes: 2 usage, 3 dlopen, 4 registration,
// 5 input, 6 output, 7 an exception from torch (loading or running the package).
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

// dlopen a binding and register its kernels under ns; the exit code on failure.
int load_binding(const char* path, const char* ns) {
  void* binding = dlopen(path, RTLD_NOW | RTLD_LOCAL);
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
  if (reg(ns, err, sizeof err) != 0) {
    std::cerr << "portable_gemm_register (" << path << "): " << err << "\n";
    return 4;
  }
  std::cout << "binding " << info() << "\n";
  return 0;
}

int run(int argc, char** argv) {
  const char* ns = "portable_gemm";
  if (argc > 2 && std::string(argv[1]) == "--namespace") {
    ns = argv[2];
    argv[2] = argv[0];  // drop the option: argv[1..] are the positional arguments again
    argc -= 2;
    argv += 2;
  }
  if (argc != 7 && argc != 8) {
    std::cerr << "usage: run_package [--namespace NS] PACKAGE IN OUT ROWS COLS CPU_BINDING [CUDA_BINDING]\n";
    return 2;
  }
  // the CPU binding first: it defines the ops, the CUDA binding only adds kernels to them
  for (int i = 6; i < argc; ++i) {
    if (int rc = load_binding(argv[i], ns)) return rc;
  }
  const bool cuda = argc == 8;

  const int64_t rows = std::stoll(argv[4]), cols = std::stoll(argv[5]);
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) {
    std::cerr << "IN: cannot open " << argv[2] << "\n";
    return 5;
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (static_cast<int64_t>(bytes.size()) != rows * cols * 2) {
    std::cerr << "IN: read " << bytes.size() << " bytes, expected " << rows * cols * 2 << "\n";
    return 5;
  }
  at::Tensor x = at::from_blob(bytes.data(), {rows, cols}, at::kBFloat16).clone();
  if (cuda) x = x.to(at::Device(at::kCUDA));

  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  std::vector<at::Tensor> outputs = loader.run({x});
  at::Tensor y = outputs.at(0).to(at::Device(at::kCPU)).contiguous();
  std::cout << "output " << y.sizes() << " " << y.scalar_type() << " from " << outputs.at(0).device() << "\n";
  std::ofstream out(argv[3], std::ios::binary);
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

// portable_gemm kernel library: the torch-free API shared by every binding.
//
// Everything here is plain data: pointers, sizes, strides (in elements), a dtype tag,
// an executor for CPU threading and an opaque CUDA stream. The library is compiled once
// and loaded by every per-target binding (and by the DLPack module); it must never see a
// torch type. Functions never throw: they return a Status whose message says what to fix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#if defined(_WIN32)
#define PG_API __declspec(dllexport)
#else
#define PG_API __attribute__((visibility("default")))
#endif

namespace portable_gemm {

// Storage types the kernels understand. Values are part of the ABI between the
// kernel library and its callers: append, never renumber.
enum class DType : int32_t { f32 = 0, f16 = 1, bf16 = 2, i8 = 3, u8 = 4 };

// Bytes per element of t.
constexpr size_t dtype_size(DType t) {
  return t == DType::f32 ? 4 : (t == DType::i8 || t == DType::u8) ? 1 : 2;
}

// Epilogue applied after the optional bias: y = act(acc + bias).
// gelu is the exact (erf) form, as torch.nn.functional.gelu's default.
enum class Activation : int32_t { none = 0, relu = 1, silu = 2, gelu = 3 };

struct Status {
  int32_t code = 0;               // 0 = ok
  const char* message = nullptr;  // static string, never freed; null when ok
  bool ok() const { return code == 0; }
};

// A strided 2-D view. Element (r, c) lives at data + r * row_stride + c * col_stride
// (strides in elements, may be any non-negative value, including 0 for broadcast).
struct ConstMatrix {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 0;
  DType dtype = DType::f32;
};
struct Matrix {
  void* data = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 0;
  DType dtype = DType::f32;
};

// Threading is the caller's: a binding for torch >= 2.10 passes torch's parallel_for
// (so torch.set_num_threads is obeyed), older targets and the DLPack module pass
// builtin_executor(), the library's own pool.
struct Executor {
  using Body = void (*)(void* ctx, int64_t begin, int64_t end);
  // Runs body over [begin, end) split into chunks of at least `grain` items, and returns
  // only when every chunk has finished. body must not throw.
  void (*parallel_for)(void* self, int64_t begin, int64_t end, int64_t grain, Body body,
                       void* ctx) = nullptr;
  int (*num_threads)(void* self) = nullptr;
  void* self = nullptr;
  const char* name = "";
};

// The library's own pool (threads = PORTABLE_GEMM_NUM_THREADS, else the last size passed to
// portable_gemm_set_pool_threads, else the hardware concurrency). Safe across fork() (the
// child re-creates its pool lazily) and at interpreter shutdown.
PG_API const Executor& builtin_executor();

// PORTABLE_GEMM_NUM_THREADS as every part of the library reads it: a whole number >= 1
// (leading blanks and a '+' allowed, nothing after the digits), else 0: unset, empty or
// malformed values are ignored (the Python loader warns about malformed ones).
inline long env_pool_threads(const char* value) {
  if (value == nullptr) return 0;
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  return end != value && *end == '\0' && v >= 1 ? v : 0;
}

// ---- dense GEMM -------------------------------------------------------------------
// c = act(a @ b + bias). a: M x K, b: K x N, c: M x N; a, b, c and bias share one dtype
// (f32, f16 or bf16); accumulation is in fp32. bias (optional, may be null) has N
// elements with stride bias_stride. Every element of c is written, also when K == 0.
struct GemmArgs {
  ConstMatrix a;
  ConstMatrix b;
  const void* bias = nullptr;
  int64_t bias_stride = 1;
  Matrix c;
  Activation activation = Activation::none;
};

// ---- weight-only quantised linear --------------------------------------------------
// Weight layout (like nn.Linear.weight, [N, K]):
//   bits = 8: int8  [N, K],     element (n, k) = q[n * q_row_stride + k]
//   bits = 4: uint8 [N, K / 2], byte (n, j) = q[n * q_row_stride + j] holds k = 2j in its
//             low nibble and k = 2j + 1 in its high nibble, each a signed 4-bit value
//             (two's complement, -8 .. 7). K must be even.
// Scales (f32, f16 or bf16): group_size == 0 -> per output channel, N values;
//   otherwise [N, K / group_size], scale (n, g) at scales[n * scales_row_stride + g].
// dequant(q)(n, k) = q(n, k) * scale(n, k / group_size).
struct QuantizedWeight {
  const void* data = nullptr;
  int64_t n = 0, k = 0;
  int64_t row_stride = 0;  // in bytes (= elements of int8/uint8)
  int32_t bits = 8;
  int64_t group_size = 0;  // 0 = per channel
  const void* scales = nullptr;
  int64_t scales_row_stride = 1;  // elements; for per-channel: stride between channels
  DType scales_dtype = DType::f32;
};

// y = act(x @ dequant(w)^T + bias). x: M x K (f32, f16 or bf16), y: M x N of x's dtype,
// bias: N elements of x's dtype (optional).
struct MixedLinearArgs {
  ConstMatrix x;
  QuantizedWeight w;
  const void* bias = nullptr;
  int64_t bias_stride = 1;
  Matrix y;
  Activation activation = Activation::none;
};

// Symmetric quantisation of w (N x K, f32/f16/bf16): per group of group_size elements
// along K (or the whole row when group_size == 0) scale = absmax / (2^(bits-1) - 1),
// rounded to scales_dtype; q = round_half_even(w / scale) clamped to
// [-2^(bits-1), 2^(bits-1) - 1]; a zero group gets scale 0 and q 0.
// qweight must be contiguous in the layout described above (row stride K or K / 2);
// scales contiguous ([N] or [N, K / group_size]).
struct QuantizeArgs {
  ConstMatrix w;
  int32_t bits = 8;
  int64_t group_size = 0;
  void* qweight = nullptr;
  void* scales = nullptr;
  DType scales_dtype = DType::f32;
};

// Shared validation used by every door (bindings, DLPack): returns a Status naming the
// argument to fix. The CPU and CUDA entry points call these themselves too.
PG_API Status validate_gemm(const GemmArgs& args);
PG_API Status validate_mixed_linear(const MixedLinearArgs& args);
PG_API Status validate_quantize(const QuantizeArgs& args);

namespace cpu {
PG_API Status gemm(const GemmArgs& args, const Executor& exec);
PG_API Status mixed_linear(const MixedLinearArgs& args, const Executor& exec);
PG_API Status quantize(const QuantizeArgs& args, const Executor& exec);
// The instruction set the CPU kernels dispatched to at run time: "avx512+bf16+amx",
// "avx512+bf16" (vdpbf16ps), "avx512", "avx2" or "generic".
PG_API const char* isa();
// On the AVX2 kernels: which rows of x weight-only runs through the dequantise-once path
// (each pair of weight rows dequantised once, then an FMA tile over every row of x), and
// why, in one line ("off ..." where it never runs). Empty under any other instruction set.
// Fixed for the process: the core and PORTABLE_GEMM_AVX2_DQ are read once.
PG_API const char* avx2_dq_path();
// For a door that has just allocated an output the kernel will write in full (bytes from
// data): on Linux, asks for transparent huge pages on its whole huge pages (2 MiB on
// x86-64; the kernel's hpage_pmd_size) when the output spans at least kHugeOutputMinBytes.
// A fresh 32 MiB output otherwise takes 8192 first-touch page faults, about 10 ms of CPU
// time (bench/CPU_NOTES.md 64). It does nothing elsewhere, for smaller outputs, or with
// PORTABLE_GEMM_HUGE_PAGES=0 in the environment. Returns whether it asked (the system may
// still give small pages: THP set to "never").
// 32 MiB is glibc's largest mmap threshold: an allocation that size or larger is a mapping
// of its own, unmapped when freed, so the advice goes with it. A smaller output may come
// from (and go back to) the heap, where the advice outlived it: the caller's own tensors
// allocated there later got huge pages too, and these outputs gained nothing from the
// advice (bench/CPU_NOTES.md 65).
constexpr size_t kHugeOutputMinBytes = size_t(32) << 20;
PG_API bool advise_new_output(void* data, size_t bytes);
}  // namespace cpu

// Build facts of the kernel library itself (version string, compiler, CUDA archs).
PG_API const char* build_info();

// A debugging aid, on in the tests: with PORTABLE_GEMM_FILL_OUTPUTS=1 in the environment
// (read once), the doors fill every output they allocate with 0xFF bytes before the kernel
// writes it (NaN in f32, f16 and bf16; -1 in int8), so that an element a kernel misses shows
// as NaN. torch's own fill (use_deterministic_algorithms) does not reach the outputs the
// torch binding allocates through the AOTI shim's empty_strided on the CPU.
PG_API bool fill_new_outputs();

// True when this kernel library was compiled with CUDA kernels.
PG_API bool has_cuda();

namespace cuda {
// Every CUDA entry point enqueues on `stream` (a cudaStream_t; null = legacy default
// stream), on the current device, and returns without synchronising. Inputs and outputs
// are device pointers of that device. Launch errors are returned as Status with
// code = the cudaError_t value. Outputs are allocated by the caller.
PG_API Status gemm(const GemmArgs& args, void* stream);
PG_API Status mixed_linear(const MixedLinearArgs& args, void* stream);
// True when mixed_linear runs these arguments on its small-M kernels (the GEMVs that read
// the weight about once): every M <= 16, and up to M = 64 where the tensor-core GEMV
// applies (f16 / bf16 x, aligned, K a multiple of its chunk). There it beat both other
// paths a caller may have at every shape measured on the H200: dequantise + cuBLAS
// (1.3-3.0x the GEMV's time at M = 17..64, graph replay) and mixed_linear's own mma.sync GEMM
// (1.5-18x); only the sm_90 fused GEMM below outruns it on large weights
// (mixed_linear_sm90_preferred). mixed_linear_path below uses it to choose.
PG_API bool mixed_linear_small_m(const MixedLinearArgs& args);
PG_API Status quantize(const QuantizeArgs& args, void* stream);
// The pieces of "dequantise, then a dense GEMM" for weight-only linears with many rows of
// x (the torch binding runs torch's matmul between them): rows n0 .. n0+rows of w
// dequantised (scale applied, rounded once) into dst [rows, K] (f16 / bf16, unit column
// stride); and out[m, n0 + j] = act(src[m, j] + bias[n0 + j]) (bias may be null; src
// [M, cols] of out's dtype, unit column stride).
PG_API Status dequantize_rows(const QuantizedWeight& w, int64_t n0, int64_t rows, Matrix dst,
                              void* stream);
PG_API Status bias_act_store(ConstMatrix src, int64_t n0, const void* bias, int64_t bias_stride,
                             Activation act, Matrix out, void* stream);
// Hopper (sm_90) fused weight-only GEMM for many rows of x: CUTLASS's mixed-input kernel
// loads the int8 / int4 weight as stored and converts + scales it in registers on the way
// to wgmma (no 16-bit copy of the weight). The workspace size in bytes it needs for these
// arguments on the current device (the scales, transposed into x's dtype, unless they are
// per-channel in x's dtype, contiguous and 16-byte aligned, and the stream-K partial sums; a
// multiple of 256, possibly 0), or -1 when it does not apply (not sm_90, built without
// CUTLASS, f32 x, groups not a multiple of 64, N not a multiple of 8, unaligned operands):
// callers then take another path. The size depends on the scales' address, stride and
// dtype as well as the shapes: query it with the same arguments as the call, not once per
// shape. The workspace passed must be 256-byte aligned (null when the size is 0).
PG_API int64_t mixed_linear_sm90_workspace(const MixedLinearArgs& args);
PG_API Status mixed_linear_sm90(const MixedLinearArgs& args, void* workspace, void* stream);
// True when these arguments are small-M rows (mixed_linear_small_m, M > 16) that the sm_90
// fused GEMM above runs faster than the small-M kernels (sm90_gemm_outruns_gemv), and it
// applies (mixed_linear_sm90_workspace >= 0). Callers that can give it a workspace (the
// torch binding) take it then; mixed_linear itself keeps the small-M kernels.
PG_API bool mixed_linear_sm90_preferred(const MixedLinearArgs& args);
// The size rule behind it, measured on the H200 (bench/GPU_NOTES.md): the GEMM has a fixed
// cost of ~10-17 us a call and then streams the weight faster than the GEMV, which reads it
// once per slice of x's rows (int4: 16 rows a slice, int8: 32). quantised_bytes is the
// weight as stored (N * K * bits / 8, scales not counted); bits and group_size (0 = per
// channel) as in QuantizedWeight.
//   M = 17..32: from 48 MiB on (runs 55a-b; 1.003x the faster path's summed time over 97
//     cases of 24 shapes), except int4 with groups of a multiple of 128, which the GEMV
//     takes in chunk pairs (run 77) at every size: run 79 timed it at 0.76-0.99x the GEMM's
//     time on 16 of 18 cases of 6 shapes of 56-112 MiB (1.02-1.05x on the other two);
//     per channel, where the GEMM needs no scale transpose, stayed even (0.83-1.13x);
//   M = 33..64: above 16 MiB (run 57; 1.001x on the 63 cases it was chosen on, 1.040x on 47
//     others, where the GEMM everywhere took 1.094x).
inline bool sm90_gemm_outruns_gemv(int64_t rows, int64_t quantised_bytes, int32_t bits, int64_t group_size) {
  if (rows <= 16 || rows > 64) return false;
  if (rows > 32) return quantised_bytes > (int64_t(16) << 20);
  if (bits == 4 && group_size > 0 && group_size % 128 == 0) return false;
  return quantised_bytes >= (int64_t(48) << 20);
}
// The path mixed_linear's arguments take, on the current device, for a caller that can
// lend scratch memory (the torch binding; mixed_linear_pooled):
//   kernels          mixed_linear itself: the small-M kernels (mixed_linear_small_m, where
//                    the sm_90 GEMM is not preferred), f32 x, K == 0, and, where the sm_90
//                    GEMM does not apply, weights whose 16-bit copy would exceed
//                    kMixedTempMaxBytes (its tensor-core GEMM, B tiles dequantised on the fly);
//   sm90             mixed_linear_sm90 with a workspace of *scratch_bytes (possibly 0);
//   dequantize_gemm  dequantize_rows into an [N, K] temporary of x's dtype (*scratch_bytes),
//                    a dense GEMM x @ temp^T, then bias_act_store.
// The library's GEMM with dequantised B tiles reaches ~0.2x cuBLAS (bench/GPU_NOTES.md,
// run 15); the sm_90 GEMM beat dequantise + GEMM at every M measured (run 20); splitting a
// larger weight into row chunks was measured 7x slower (run 17).
enum class MixedLinearPath : int32_t { kernels = 0, sm90 = 1, dequantize_gemm = 2 };
constexpr int64_t kMixedTempMaxBytes = int64_t(512) << 20;
PG_API MixedLinearPath mixed_linear_path(const MixedLinearArgs& args, int64_t* scratch_bytes);
// mixed_linear for callers without an allocator of their own (the DLPack door): the path
// above, its scratch memory taken stream-ordered from the current device's current memory
// pool (cudaMallocAsync / cudaFreeAsync on `stream`: no synchronisation), and this
// library's gemm as the dense GEMM. Where the pool cannot lend it (no memory-pool
// support, out of memory), mixed_linear. Same arguments and result as mixed_linear.
PG_API Status mixed_linear_pooled(const MixedLinearArgs& args, void* stream);
// cudaGetErrorString of the library's own runtime (static cudart).
PG_API const char* error_string(int32_t code);
// For callers without an allocator of their own (the DLPack door): device memory on
// `device`, and making `device` current (previous one returned, to restore it after).
PG_API Status device_alloc(void** ptr, size_t bytes, int32_t device);
// bytes of device memory at data set to 0xFF, enqueued on `stream` (fill_new_outputs); with a
// null stream it returns after the fill has finished.
PG_API Status fill_bytes(void* data, size_t bytes, void* stream);
PG_API void device_free(void* ptr, int32_t device);
PG_API Status set_device(int32_t device, int32_t* previous);
}  // namespace cuda

}  // namespace portable_gemm

// Sizes the library's own pool from now on: n threads (n >= 1; n < 1 changes nothing).
// Returns the size in use, which PORTABLE_GEMM_NUM_THREADS overrides where set. For callers
// whose torch has no stable parallel_for to lend (target 2.9): the Python package passes
// torch.get_num_threads(), so that torch.set_num_threads applies on every target.
extern "C" PG_API int portable_gemm_set_pool_threads(int n);

// The CPU kernels' scratch: every thread that has run a CPU kernel keeps its packed panels,
// partial sums and converted inputs in buffers that grow to the largest call it has seen
// and are kept for the next call (a fresh 32 MiB buffer costs ~5 ms of page faults).
// portable_gemm_cpu_scratch_bytes: the bytes those buffers hold now, all threads together.
// portable_gemm_release_cpu_scratch: frees the buffers of every thread that is not inside a
// CPU kernel call at that moment (it never waits for one; a thread inside keeps its
// buffers), then, with glibc, returns the heap's free memory to the system (malloc_trim).
// Returns the bytes freed. The next call on each thread allocates what it needs again.
extern "C" PG_API size_t portable_gemm_cpu_scratch_bytes(void);
extern "C" PG_API size_t portable_gemm_release_cpu_scratch(void);

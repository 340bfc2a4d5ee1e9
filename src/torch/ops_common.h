// The op bodies shared by the CPU and CUDA bindings: check inputs (messages say what to
// change), describe tensors to the kernel library as strided 2-D views, allocate outputs.
// The device-specific part is a Backend with run(args) for each kernel.
#pragma once

#include <portable_gemm/kernels.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "compat/alloc.h"
#include "compat/library.h"
#include "compat/tensor_access.h"

namespace portable_gemm::binding {

// A bad input: throws std::runtime_error (torch raises it as RuntimeError) whose message is
// the parts streamed together, "portable_gemm.gemm: a must be ...". STD_TORCH_CHECK throws
// the same type but puts the C++ function, file and line first ("check_float,
// src/torch/ops_common.h:58, ..."), which tells the user nothing they can change.
template <typename... Parts>
[[noreturn]] inline void fail(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw std::runtime_error(os.str());
}
#define PG_CHECK(cond, ...)                                   \
  do {                                                        \
    if (!(cond)) ::portable_gemm::binding::fail(__VA_ARGS__); \
  } while (0)

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

inline const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Char: return "int8";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Double: return "float64";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    default: return "an unsupported dtype";
  }
}

inline bool is_float_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

inline DType kernel_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return DType::f32;
    case ScalarType::Half: return DType::f16;
    case ScalarType::BFloat16: return DType::bf16;
    case ScalarType::Char: return DType::i8;
    default: return DType::u8;
  }
}

inline void check_float(const Tensor& t, const char* op, const char* name) {
  PG_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name,
           " must be float32, float16 or bfloat16, got ", dtype_name(t.scalar_type()));
}

inline void check_same_device(const Tensor& ref, const Tensor& t, const char* op,
                              const char* ref_name, const char* name) {
  const bool same = ref.is_cuda() == t.is_cuda() &&
                    (!ref.is_cuda() || ref.get_device_index() == t.get_device_index());
  if (!same) {
    auto where = [](const Tensor& x) {
      return x.is_cuda() ? "cuda:" + std::to_string(x.get_device_index()) : std::string("cpu");
    };
    fail(op, ": ", name, " is on ", where(t), " but ", ref_name, " is on ", where(ref),
         "; move all inputs to one device");
  }
}

inline Activation to_activation(int64_t a, const char* op) {
  PG_CHECK(a >= 0 && a <= 3, op, ": activation code ", a,
           " is unknown (0 none, 1 relu, 2 silu, 3 gelu)");
  return static_cast<Activation>(a);
}

// A tensor [..., cols] seen as rows x cols, if its leading dims merge into one stride.
inline std::optional<ConstMatrix> as_rows(const Tensor& t) {
  const int64_t nd = t.dim();
  ConstMatrix m;
  m.data = compat::const_data(t);
  m.dtype = kernel_dtype(t.scalar_type());
  m.cols = t.size(nd - 1);
  m.col_stride = t.stride(nd - 1);
  m.rows = 1;
  m.row_stride = m.cols;  // any value works when rows <= 1
  for (int64_t d = 0; d + 1 < nd; ++d) m.rows *= t.size(d);
  if (m.rows == 0) return m;  // nothing to read: any stride will do
  m.rows = 1;
  int64_t expected = -1;  // stride the next outer dim must have to merge
  for (int64_t d = nd - 2; d >= 0; --d) {
    const int64_t size = t.size(d);
    m.rows *= size;
    if (size == 1) continue;
    if (expected < 0) {
      m.row_stride = t.stride(d);
    } else if (t.stride(d) != expected) {
      return std::nullopt;
    }
    expected = t.stride(d) * size;
  }
  return m;
}

inline Matrix as_output(const Tensor& out, int64_t rows, int64_t cols) {
  Matrix m;
  m.data = compat::mutable_data(out);
  m.rows = rows;
  m.cols = cols;
  m.row_stride = cols > 0 ? cols : 1;  // an empty row still needs a valid stride
  m.col_stride = 1;
  m.dtype = kernel_dtype(out.scalar_type());
  return m;
}

// Rows view of t, copying it only when its leading dims cannot be merged; `keep` holds
// the copy alive for the duration of the call.
inline ConstMatrix rows_view(const Tensor& t, std::optional<Tensor>& keep) {
  if (auto m = as_rows(t)) return *m;
  keep = compat::contiguous_copy(t);
  return *as_rows(*keep);
}

// The outputs an op's arguments point at, as (data, bytes): all of them fresh and contiguous
// (new_output), for fill_new_outputs.
struct Span {
  void* data;
  size_t bytes;
};
inline size_t fresh_bytes(const Matrix& m) { return size_t(m.rows) * size_t(m.cols) * dtype_size(m.dtype); }
inline std::vector<Span> fresh_outputs(const GemmArgs& a) { return {{a.c.data, fresh_bytes(a.c)}}; }
inline std::vector<Span> fresh_outputs(const MixedLinearArgs& a) { return {{a.y.data, fresh_bytes(a.y)}}; }
inline std::vector<Span> fresh_outputs(const QuantizeArgs& a) {
  const size_t n = size_t(a.w.rows), k = size_t(a.w.cols);
  const size_t groups = a.group_size > 0 ? k / size_t(a.group_size) : 1;
  return {{a.qweight, n * (a.bits == 8 ? k : k / 2)}, {a.scales, n * groups * dtype_size(a.scales_dtype)}};
}

inline void throw_if_error(const Status& s, const char* op) {
  PG_CHECK(s.ok(), op, ": ", s.message ? s.message : "kernel failed");
}

inline std::vector<int64_t> leading_sizes(const Tensor& t) {
  std::vector<int64_t> s(t.sizes().begin(), t.sizes().end());
  s.pop_back();
  return s;
}

// bias: optional [N] of the input's dtype, on the input's device.
inline void check_bias(const std::optional<Tensor>& bias, const Tensor& input, int64_t N,
                       const char* op, const char* input_name) {
  if (!bias) return;
  check_same_device(input, *bias, op, input_name, "bias");
  PG_CHECK(bias->scalar_type() == input.scalar_type(), op, ": bias has dtype ",
           dtype_name(bias->scalar_type()), " but ", input_name, " has ",
           dtype_name(input.scalar_type()));
  PG_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [N] = [", N, "]");
}

// The part gemm and mixed_linear share: bias + activation epilogue, and the [..., N]
// output in the input's dtype, described to the kernel as `rows` x N.
template <class Args>
Tensor add_epilogue_and_output(Args& args, Matrix Args::*out_field, int64_t rows, const Tensor& input,
                               int64_t N, const std::optional<Tensor>& bias, int64_t activation,
                               const char* op) {
  if (bias) {
    args.bias = compat::const_data(*bias);
    args.bias_stride = bias->stride(0);
  }
  args.activation = to_activation(activation, op);
  auto sizes = leading_sizes(input);
  sizes.push_back(N);
  Tensor out = compat::new_output(input, sizes, input.scalar_type());
  args.*out_field = as_output(out, rows, N);
  return out;
}

// "NS.gemm" and so on, the ops' names in error messages: NS is the namespace this binding
// registered under (a vendored copy's own), set by register_namespace before the ops exist.
struct OpNames {
  std::string gemm = "portable_gemm.gemm", quantize_weight = "portable_gemm.quantize_weight",
              mixed_linear = "portable_gemm.mixed_linear";
};
inline OpNames& op_names() {
  static OpNames names;
  return names;
}

template <class Backend>
Tensor gemm(Tensor a, Tensor b, std::optional<Tensor> bias, int64_t activation) {
  const char* op = op_names().gemm.c_str();
  PG_CHECK(a.dim() >= 1, op, ": a must have shape [..., K], got a 0-dim tensor");
  PG_CHECK(b.dim() == 2, op, ": b must have shape [K, N], got ", b.dim(), " dims");
  check_float(a, op, "a");
  PG_CHECK(b.scalar_type() == a.scalar_type(), op, ": b has dtype ",
           dtype_name(b.scalar_type()), " but a has ", dtype_name(a.scalar_type()),
           "; cast both to one dtype");
  check_same_device(a, b, op, "a", "b");
  const int64_t K = a.size(a.dim() - 1), N = b.size(1);
  PG_CHECK(b.size(0) == K, op, ": a has K = ", K, " columns but b has ", b.size(0),
           " rows; b must be [K, N]");
  check_bias(bias, a, N, op, "a");
  Backend::check_device(a, op);

  std::optional<Tensor> a_copy;
  GemmArgs args;
  args.a = rows_view(a, a_copy);
  args.b = ConstMatrix{compat::const_data(b), K, N, b.stride(0), b.stride(1), kernel_dtype(b.scalar_type())};
  Tensor out = add_epilogue_and_output(args, &GemmArgs::c, args.a.rows, a, N, bias, activation, op);
  throw_if_error(validate_gemm(args), op);
  Backend::run(args, a, op);
  return out;
}

inline int64_t checked_group_size(int64_t group_size, int64_t K, const char* op) {
  PG_CHECK(group_size >= 0, op, ": group_size must be None (per channel) or positive, got ",
           group_size);
  if (group_size > 0)
    PG_CHECK(K % group_size == 0, op, ": group_size ", group_size, " must divide K = ", K);
  return group_size;
}

template <class Backend>
std::tuple<Tensor, Tensor> quantize_weight(Tensor weight, int64_t bits, int64_t group_size) {
  const char* op = op_names().quantize_weight.c_str();
  PG_CHECK(weight.dim() == 2, op, ": weight must have shape [N, K] like nn.Linear.weight, got ",
           weight.dim(), " dims");
  check_float(weight, op, "weight");
  PG_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  const int64_t N = weight.size(0), K = weight.size(1);
  checked_group_size(group_size, K, op);
  if (bits == 4) PG_CHECK(K % 2 == 0, op, ": int4 packs two values per byte, so K (", K, ") must be even");
  Backend::check_device(weight, op);

  QuantizeArgs args;
  args.w = ConstMatrix{compat::const_data(weight), N, K, weight.stride(0), weight.stride(1),
                       kernel_dtype(weight.scalar_type())};
  args.bits = static_cast<int32_t>(bits);
  args.group_size = group_size;
  Tensor q = compat::new_output(weight, {N, bits == 8 ? K : K / 2},
                                bits == 8 ? ScalarType::Char : ScalarType::Byte);
  std::vector<int64_t> scale_sizes = group_size ? std::vector<int64_t>{N, K / group_size}
                                                : std::vector<int64_t>{N};
  Tensor scales = compat::new_output(weight, scale_sizes, weight.scalar_type());
  args.qweight = compat::mutable_data(q);
  args.scales = compat::mutable_data(scales);
  args.scales_dtype = kernel_dtype(weight.scalar_type());
  throw_if_error(validate_quantize(args), op);
  Backend::run(args, weight, op);
  return {q, scales};
}

template <class Backend>
Tensor mixed_linear(Tensor x, Tensor qweight, Tensor scales, int64_t bits, int64_t group_size,
                    std::optional<Tensor> bias, int64_t activation) {
  const char* op = op_names().mixed_linear.c_str();
  PG_CHECK(x.dim() >= 1, op, ": x must have shape [..., K], got a 0-dim tensor");
  check_float(x, op, "x");
  PG_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
  PG_CHECK(qweight.dim() == 2, op, ": qweight must be 2-D [N, K] (int8) or [N, K/2] (int4), got ",
           qweight.dim(), " dims");
  const ScalarType qtype = bits == 8 ? ScalarType::Char : ScalarType::Byte;
  PG_CHECK(qweight.scalar_type() == qtype, op, ": bits=", bits, " needs qweight of dtype ",
           dtype_name(qtype), ", got ", dtype_name(qweight.scalar_type()),
           " (use quantize_weight)");
  const int64_t K = x.size(x.dim() - 1), N = qweight.size(0);
  const int64_t packed_k = bits == 8 ? K : K / 2;
  PG_CHECK(bits == 8 || K % 2 == 0, op, ": int4 needs an even K, got K = ", K);
  PG_CHECK(qweight.size(1) == packed_k, op, ": qweight has shape [", N, ", ", qweight.size(1),
           "] but x has K = ", K, ", so it must be [N, ", packed_k, "]",
           bits == 4 ? " (int4: two values per byte)" : "");
  checked_group_size(group_size, K, op);
  check_float(scales, op, "scales");
  const std::vector<int64_t> want = group_size ? std::vector<int64_t>{N, K / group_size}
                                               : std::vector<int64_t>{N};
  const std::vector<int64_t> got(scales.sizes().begin(), scales.sizes().end());
  if (got != want) {
    // Which group_size scales of this shape come from, where that can be read off them.
    std::string hint;
    if (got.size() == 2 && got[0] == N && got[1] > 0 && K % got[1] == 0)
      hint = "; scales of shape [" + std::to_string(N) + ", " + std::to_string(got[1]) +
             "] come from group_size=" + std::to_string(K / got[1]);
    else if (got.size() == 1 && got[0] == N)
      hint = "; scales of shape [N] come from group_size=None";
    fail(op, ": scales must have shape ",
         group_size ? "[N, K / group_size] = [" + std::to_string(N) + ", " +
                          std::to_string(K / group_size) + "]"
                    : "[N] = [" + std::to_string(N) + "]",
         " for group_size=", group_size ? std::to_string(group_size) : std::string("None (per channel)"),
         hint);
  }
  check_same_device(x, qweight, op, "x", "qweight");
  check_same_device(x, scales, op, "x", "scales");
  check_bias(bias, x, N, op, "x");
  Backend::check_device(x, op);

  // The weight kernels read rows of bytes and rows of scales: unit inner strides needed.
  std::optional<Tensor> x_copy, q_copy, s_copy;
  // Rows of bytes / scales with unit inner stride and non-overlapping rows; anything else
  // (transposed, expanded with stride 0) is copied once.
  const int64_t n_groups = group_size ? K / group_size : 1;
  if (N > 1 && qweight.stride(0) < packed_k) q_copy = compat::contiguous_copy(qweight);
  else if (qweight.stride(1) != 1 && packed_k > 1) q_copy = compat::contiguous_copy(qweight);
  if (N > 1 && scales.stride(0) < n_groups) s_copy = compat::contiguous_copy(scales);
  else if (group_size && scales.stride(1) != 1 && n_groups > 1) s_copy = compat::contiguous_copy(scales);
  const Tensor& q = q_copy ? *q_copy : qweight;
  const Tensor& s = s_copy ? *s_copy : scales;

  MixedLinearArgs args;
  args.x = rows_view(x, x_copy);
  args.w.data = compat::const_data(q);
  args.w.n = N;
  args.w.k = K;
  args.w.row_stride = q.stride(0);
  args.w.bits = static_cast<int32_t>(bits);
  args.w.group_size = group_size;
  args.w.scales = compat::const_data(s);
  args.w.scales_row_stride = s.stride(0);
  args.w.scales_dtype = kernel_dtype(s.scalar_type());
  Tensor out = add_epilogue_and_output(args, &MixedLinearArgs::y, args.x.rows, x, N, bias, activation, op);
  throw_if_error(validate_mixed_linear(args), op);
  Backend::run(args, x, op);
  return out;
}

// Schemas: one place, one line each. Optional ints are 0 = "none" (per channel).
inline void define_schemas(compat::Library& lib) {
  // y = act(a @ b + bias); a [..., K], b [K, N]; activation 0 none, 1 relu, 2 silu, 3 gelu
  lib.define("gemm(Tensor a, Tensor b, Tensor? bias=None, int activation=0) -> Tensor");
  // symmetric int8/int4 weight quantisation; group_size 0 = per output channel
  lib.define("quantize_weight(Tensor weight, int bits, int group_size=0) -> (Tensor, Tensor)");
  // y = act(x @ dequant(qweight).T + bias)
  lib.define(
      "mixed_linear(Tensor x, Tensor qweight, Tensor scales, int bits, int group_size=0, "
      "Tensor? bias=None, int activation=0) -> Tensor");
}

template <class Backend>
void register_kernels(compat::Library& lib) {
  lib.kernel("gemm", TORCH_BOX(&gemm<Backend>));
  lib.kernel("quantize_weight", TORCH_BOX(&quantize_weight<Backend>));
  lib.kernel("mixed_linear", TORCH_BOX(&mixed_linear<Backend>));
}

// Registers once per namespace per loaded binary; a second call for the same namespace
// (the package re-imported) is a no-op. Never throws across the C boundary.
template <class Backend>
int register_namespace(const char* ns, bool define, char* err, size_t errlen) noexcept {
  static std::mutex mu;
  static std::set<std::string> done;
  try {
    std::lock_guard<std::mutex> lock(mu);
    if (!ns || !*ns) throw std::runtime_error("empty namespace");
    if (done.count(ns)) return 0;
    if (done.empty()) {  // the first namespace names the ops in messages (one per binary in practice)
      const std::string n(ns);
      op_names() = OpNames{n + ".gemm", n + ".quantize_weight", n + ".mixed_linear"};
    }
    if (define) {
      auto def = compat::Library::def(ns);
      define_schemas(def);
    }
    auto impl = compat::Library::impl(ns, Backend::dispatch_key);
    register_kernels<Backend>(impl);
    done.insert(ns);
    return 0;
  } catch (const std::exception& e) {
    if (err && errlen) {
      std::strncpy(err, e.what(), errlen - 1);
      err[errlen - 1] = '\0';
    }
    return dynamic_cast<const compat::NamespaceTaken*>(&e) ? 2 : 1;
  }
}

}  // namespace portable_gemm::binding

// Exported entry points every binding has (the loader's contract, see _loader.py):
//   int  portable_gemm_register(const char* ns, char* err, size_t errlen)
//        0 registered (or already, by this binary), 2 the namespace is defined already in
//        this process (by another library), 1 any other failure; err says what happened
//   const char* portable_gemm_binding_info()   JSON: target, device, features compiled in
#define PG_BINDING_EXPORT extern "C" __attribute__((visibility("default")))

// portable_gemm._dlpack: gemm / quantize_weight / mixed_linear for any array that speaks
// DLPack or the buffer protocol (NumPy on the CPU; CuPy, JAX or torch on CUDA), without
// torch. Same kernel library, same validation; CPU threads from the library's own pool; on
// CUDA the work is enqueued on the `stream` argument (default 0: the legacy default stream)
// and outputs are allocated on the inputs' device.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <portable_gemm/kernels.h>

#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <optional>
#include <string>

namespace nb = nanobind;
namespace pg = portable_gemm;

namespace {

using Array = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;  // writable: out=

// Where the operands live: all of one call must agree.
struct Where {
  bool cuda = false;
  int32_t device = 0;
  bool operator==(const Where& o) const { return cuda == o.cuda && (!cuda || device == o.device); }
  std::string str() const { return cuda ? "cuda:" + std::to_string(device) : std::string("cpu"); }
};

template <class A>
Where where_of(const A& a, const char* name) {
  if (a.device_type() == nb::device::cpu::value) return {};
  if (a.device_type() == nb::device::cuda::value) return {true, static_cast<int32_t>(a.device_id())};
  throw nb::type_error((std::string(name) + " lives on a device this door does not support (CPU and CUDA only)").c_str());
}

Where same_place(std::initializer_list<std::pair<const Array*, const char*>> arrays) {
  const auto& first = *arrays.begin();
  const Where w = where_of(*first.first, first.second);
  for (const auto& [a, name] : arrays) {
    if (!a) continue;
    const Where o = where_of(*a, name);
    if (!(o == w))
      throw nb::value_error((std::string(name) + " is on " + o.str() + " but " + first.second + " is on " + w.str() +
                             "; move all arrays to one device").c_str());
  }
  return w;
}

const char* dtype_label(nb::dlpack::dtype t) {
  if (t == nb::dtype<float>()) return "float32";
  if (t == nb::dtype<double>()) return "float64";
  if (t == nb::dtype<int8_t>()) return "int8";
  if (t == nb::dtype<uint8_t>()) return "uint8";
  if (t == nb::dtype<uint16_t>()) return "uint16";
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) return "float16";
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return "bfloat16";
  return "an unsupported dtype";
}

// Float operand dtype. NumPy has no bfloat16: bf16 data travels as uint16 bit patterns with
// bf16_bits=True (e.g. `x.view(np.uint16)` of an ml_dtypes.bfloat16 array).
template <class A>
pg::DType float_dtype(const A& a, const char* name, bool bf16_bits) {
  const auto t = a.dtype();
  if (t == nb::dtype<float>()) return pg::DType::f32;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) return pg::DType::f16;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return pg::DType::bf16;
  if (bf16_bits && t == nb::dtype<uint16_t>()) return pg::DType::bf16;
  throw nb::type_error((std::string(name) + " must be float32, float16 or bfloat16 (or uint16 bit patterns "
                        "with bf16_bits=True), got " + dtype_label(t)).c_str());
}

pg::ConstMatrix matrix(const Array& a, const char* name, pg::DType dt) {
  if (a.ndim() != 2)
    throw nb::value_error((std::string(name) + " must be 2-D, got " + std::to_string(a.ndim()) + " dims").c_str());
  return pg::ConstMatrix{a.data(), (int64_t)a.shape(0), (int64_t)a.shape(1), (int64_t)a.stride(0),
                         (int64_t)a.stride(1), dt};
}

pg::Activation activation(const std::string& name) {
  if (name == "none") return pg::Activation::none;
  if (name == "relu") return pg::Activation::relu;
  if (name == "silu") return pg::Activation::silu;
  if (name == "gelu") return pg::Activation::gelu;
  throw nb::value_error(("activation must be one of none, relu, silu, gelu; got '" + name + "'").c_str());
}

size_t elem_size(pg::DType t) { return t == pg::DType::f32 ? 4 : (t == pg::DType::i8 || t == pg::DType::u8) ? 1 : 2; }

nb::dlpack::dtype dl_dtype(pg::DType t, bool bf16_bits) {
  switch (t) {
    case pg::DType::f32: return nb::dtype<float>();
    case pg::DType::f16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case pg::DType::bf16:
      return bf16_bits ? nb::dtype<uint16_t>()
                       : nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case pg::DType::i8: return nb::dtype<int8_t>();
    default: return nb::dtype<uint8_t>();
  }
}

// A fresh, owned, C-contiguous array on the operands' device, of the input's framework.
struct Output {
  void* data = nullptr;
  size_t shape[2] = {0, 0};
  size_t ndim = 2;
  pg::DType dtype;
  Where where;
  Output(std::initializer_list<size_t> dims, pg::DType t, Where w) : dtype(t), where(w) {
    ndim = dims.size();
    size_t n = 1, i = 0;
    for (size_t d : dims) n *= (shape[i++] = d);
    const size_t bytes = ((n * elem_size(t) + 63) / 64) * 64 + 64;
    if (w.cuda) {
      const pg::Status s = pg::cuda::device_alloc(&data, bytes, w.device);
      if (!s.ok()) throw nb::value_error((std::string("CUDA allocation failed: ") + s.message).c_str());
    } else {
      data = std::aligned_alloc(64, bytes);
      if (!data) throw std::bad_alloc();
    }
    if (pg::fill_new_outputs()) fill(bytes);
  }
  // PORTABLE_GEMM_FILL_OUTPUTS=1 (the tests): 0xFF bytes (NaN) before the kernel writes it.
  // On CUDA through the legacy default stream, finished before the call's own stream runs.
  void fill(size_t bytes) {
    if (!where.cuda) {
      std::memset(data, 0xFF, bytes);
      return;
    }
    int32_t previous = 0;
    if (pg::cuda::set_device(where.device, &previous).ok()) {
      const pg::Status s = pg::cuda::fill_bytes(data, bytes, nullptr);
      pg::cuda::set_device(previous, &previous);
      if (!s.ok()) {
        pg::cuda::device_free(data, where.device);
        throw nb::value_error((std::string("CUDA fill failed: ") + s.message).c_str());
      }
    }
  }
  Output(const Output&) = delete;
  Output(Output&& o) noexcept : data(o.data), ndim(o.ndim), dtype(o.dtype), where(o.where) {
    shape[0] = o.shape[0];
    shape[1] = o.shape[1];
    o.data = nullptr;  // the moved-from one must not free it
  }
  static void release(void* p, const Where& w) noexcept {
    if (!p) return;
    if (w.cuda) pg::cuda::device_free(p, w.device);
    else std::free(p);
  }
  nb::object to_python(nb::handle like, bool bf16_bits) {
    nb::capsule owner;
    if (where.cuda) {
      // the capsule's deleter gets only the pointer: remember the device beside it
      struct Block { void* p; int32_t device; };
      auto* b = new Block{data, where.device};
      owner = nb::capsule(b, [](void* q) noexcept {
        auto* blk = static_cast<Block*>(q);
        pg::cuda::device_free(blk->p, blk->device);
        delete blk;
      });
    } else {
      owner = nb::capsule(data, [](void* p) noexcept { std::free(p); });
    }
    void* ptr = data;
    data = nullptr;
    const auto dt = dl_dtype(dtype, bf16_bits);
    nb::ndarray<> arr(ptr, ndim, shape, owner, nullptr, dt,
                      where.cuda ? nb::device::cuda::value : nb::device::cpu::value, where.device);
    std::string mod = nb::borrow<nb::str>(nb::handle(like.type()).attr("__module__")).c_str();
    if (mod.rfind("torch", 0) == 0) return nb::cast(nb::ndarray<nb::pytorch>(arr));
    if (mod.rfind("jax", 0) == 0) return nb::cast(nb::ndarray<nb::jax>(arr));
    if (mod.rfind("cupy", 0) == 0) return nb::cast(nb::ndarray<nb::cupy>(arr));
    if (where.cuda) return nb::cast(arr);  // any DLPack consumer can take it
    return nb::cast(nb::ndarray<nb::numpy>(arr));
  }
  ~Output() { release(data, where); }
};

// Is the interpreter finalising? Read without the GIL through Py_IsFinalizing (3.13+) or
// _Py_IsFinalizing (older); looked up at import because neither is in the limited API that
// the abi3 build compiles against.
using IsFinalizing = int (*)();
IsFinalizing g_is_finalizing = nullptr;

void find_is_finalizing() {
  void* f = dlsym(RTLD_DEFAULT, "Py_IsFinalizing");
  if (f == nullptr) f = dlsym(RTLD_DEFAULT, "_Py_IsFinalizing");
  g_is_finalizing = reinterpret_cast<IsFinalizing>(f);
}

// Releases the GIL around a kernel. Taking it back while the interpreter finalises makes
// CPython < 3.14 end the thread with pthread_exit(); its forced unwind through a noexcept
// destructor (nanobind's gil_scoped_release, like pybind11's: pytorch/pytorch#38228) calls
// std::terminate and takes the whole process down. A daemon thread that comes back from a
// kernel that late parks instead, as CPython 3.14 does with such threads; exit() ends it.
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;
  ~GilRelease() {
    if (g_is_finalizing != nullptr && g_is_finalizing() != 0)
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

// Runs the kernel where the operands live: the CPU pool, or `stream` on their CUDA device.
template <class Args>
void run(const Args& args, const Where& w, uintptr_t stream, pg::Status (*cpu_fn)(const Args&, const pg::Executor&),
         pg::Status (*cuda_fn)(const Args&, void*)) {
  pg::Status s;
  {
    GilRelease release;
    if (w.cuda) {
      int32_t previous = 0;
      s = pg::cuda::set_device(w.device, &previous);
      if (s.ok()) s = cuda_fn(args, reinterpret_cast<void*>(stream));
      pg::cuda::set_device(previous, nullptr);
    } else {
      s = cpu_fn(args, pg::builtin_executor());
    }
  }
  if (!s.ok()) throw nb::value_error(s.message ? s.message : "kernel failed");
}

// torch.Tensor where torch is imported already (the door never imports it), else null.
PyObject* torch_tensor_type() {
  static PyObject* type = nullptr;  // a reference kept for the process (under the GIL)
  if (type == nullptr) {
    PyObject* modules = PySys_GetObject("modules");  // borrowed
    PyObject* torch = modules ? PyDict_GetItemString(modules, "torch") : nullptr;  // borrowed
    if (torch != nullptr) type = PyObject_GetAttrString(torch, "Tensor");
    if (type == nullptr) PyErr_Clear();
  }
  return type;
}

// A torch tensor that requires grad: the door runs outside autograd, so its result would
// carry no gradient, and a write into it (out=) would be hidden from autograd. Refused, as
// torch's own __dlpack__ refuses to export such a tensor.
void refuse_autograd(nb::handle h, const char* name) {
  PyObject* tensor = torch_tensor_type();
  if (tensor == nullptr || PyObject_IsInstance(h.ptr(), tensor) != 1) return;
  nb::object rg = nb::getattr(h, "requires_grad", nb::bool_(false));
  if (PyObject_IsTrue(rg.ptr()) == 1)
    throw nb::type_error((std::string(name) + " requires grad, and the DLPack door runs outside autograd (no "
                          "gradient would reach it): use portable_gemm's torch ops (portable_gemm.gemm, "
                          "portable_gemm.mixed_linear), or pass " + name + ".detach()").c_str());
}

// Why nanobind could not import `h` as an array, where a common case says more than its type.
std::string not_an_array(nb::handle h) {
  nb::object dtype = nb::getattr(h, "dtype", nb::none());
  nb::object order = dtype.is_none() ? nb::none() : nb::getattr(dtype, "byteorder", nb::none());
  std::string o;
  if (nb::try_cast<std::string>(order, o) && (o == ">" || o == "<"))  // '=' native, '|' one byte
    return std::string(nb::inst_name(h).c_str()) + " of non-native byte order (" + o +
           "); convert it first, e.g. a.astype(a.dtype.newbyteorder('='))";
  return nb::inst_name(h).c_str();
}

Array as_array(nb::handle h, const char* name) {
  refuse_autograd(h, name);
  Array a;
  if (!nb::try_cast<Array>(h, a))
    throw nb::type_error((std::string(name) + " must be an array (NumPy, or any object with __dlpack__ on the "
                          "CPU or a CUDA device), got " + not_an_array(h)).c_str());
  return a;
}

void check(const pg::Status& s) {  // validation results
  if (!s.ok()) throw nb::value_error(s.message ? s.message : "invalid arguments");
}

// The bytes an array's elements span, [first, last): empty for an array with no elements.
template <class A>
std::pair<uintptr_t, uintptr_t> byte_span(const A& a) {
  const auto base = reinterpret_cast<uintptr_t>(a.data());
  const auto item = static_cast<intptr_t>(a.itemsize());
  intptr_t lo = 0, hi = 0;
  for (size_t d = 0; d < a.ndim(); ++d) {
    if (a.shape(d) == 0) return {base, base};
    const intptr_t reach = static_cast<intptr_t>(a.shape(d) - 1) * static_cast<intptr_t>(a.stride(d)) * item;
    (reach < 0 ? lo : hi) += reach;
  }
  return {base + lo, base + hi + item};
}

// Where the result goes: a fresh array, or the caller's `out` (returned as given; its
// import is held until the kernel has run, like the operands').
struct Result {
  std::optional<Output> fresh;
  nb::handle out;
  OutArray held;
  nb::object to_python(nb::handle like, bool bf16_bits) {
    return fresh ? fresh->to_python(like, bf16_bits) : nb::borrow(out);
  }
};

// out=: a writable rows x n array of the result's dtype on the operands' device, with unit
// column stride (any row stride >= n, e.g. a column slice of a wider buffer), sharing no
// byte with an operand. Checked before any kernel runs, so a refused call leaves it as it was.
pg::Matrix out_matrix(nb::handle out_obj, OutArray& o, int64_t rows, int64_t n, pg::DType dt, const Where& w,
                      bool bf16_bits, std::initializer_list<std::pair<const Array*, const char*>> operands) {
  // A bare DLPack capsule is consumed by its import: the caller could not read the result
  if (nb::isinstance<nb::capsule>(out_obj))
    throw nb::type_error("out must be the array itself, not a DLPack capsule (the capsule is used up once read)");
  refuse_autograd(out_obj, "out");
  if (!nb::try_cast<OutArray>(out_obj, o))
    throw nb::type_error(("out must be a writable array (NumPy, or any object with __dlpack__ on the CPU or a "
                          "CUDA device), got " + std::string(nb::inst_name(out_obj).c_str()) +
                          " (a read-only NumPy array is refused too)").c_str());
  const Where ow = where_of(o, "out");
  if (!(ow == w))
    throw nb::value_error(("out is on " + ow.str() + " but the operands are on " + w.str()).c_str());
  if (float_dtype(o, "out", bf16_bits) != dt)
    throw nb::type_error((std::string("out must have the result's dtype, the input's; got ") + dtype_label(o.dtype()))
                             .c_str());
  if (o.ndim() != 2 || o.shape(0) != (size_t)rows || o.shape(1) != (size_t)n)
    throw nb::value_error(("out must be 2-D of shape (" + std::to_string(rows) + ", " + std::to_string(n) + ")").c_str());
  if (rows > 0 && n > 1 && o.stride(1) != 1)
    throw nb::value_error("out must have unit column stride (rows may be padded: a column slice of a wider buffer)");
  if (rows > 1 && n > 0 && o.stride(0) < n)
    throw nb::value_error("out's rows must not overlap each other (row stride >= N)");
  const auto [first, last] = byte_span(o);
  for (const auto& [a, name] : operands) {
    if (!a || first == last) continue;
    const auto [afirst, alast] = byte_span(*a);
    if (afirst != alast && afirst < last && first < alast)
      throw nb::value_error(("out overlaps " + std::string(name) + "; write the result to memory no operand uses")
                                .c_str());
  }
  return pg::Matrix{o.data(), rows, n, rows > 1 ? (int64_t)o.stride(0) : std::max<int64_t>(n, 1), 1, dt};
}

// What gemm and mixed_linear share: the bias ([N], the input's dtype), the activation, and
// the rows x N output on the operands' device (fresh, or the caller's out).
template <class Args>
Result epilogue_and_output(Args& args, pg::Matrix Args::*out_field, int64_t rows, int64_t n,
                           const std::optional<Array>& bias, const std::string& act, pg::DType dt, const Where& w,
                           const char* input, bool bf16_bits, std::optional<nb::handle> out,
                           std::initializer_list<std::pair<const Array*, const char*>> operands) {
  if (bias) {
    if (float_dtype(*bias, "bias", bf16_bits) != dt)
      throw nb::type_error(("bias must have " + std::string(input) + "'s dtype, got " + dtype_label(bias->dtype()))
                               .c_str());
    if (bias->ndim() != 1 || bias->shape(0) != (size_t)n)
      throw nb::value_error(("bias must be a 1-D array of N = " + std::to_string(n) + " elements").c_str());
    args.bias = bias->data();
    args.bias_stride = bias->stride(0);
  }
  args.activation = activation(act);
  Result r;
  if (out) {
    r.out = *out;
    args.*out_field = out_matrix(*out, r.held, rows, n, dt, w, bf16_bits, operands);
  } else {
    r.fresh.emplace(std::initializer_list<size_t>{(size_t)rows, (size_t)n}, dt, w);
    args.*out_field = pg::Matrix{r.fresh->data, rows, n, std::max<int64_t>(n, 1), 1, dt};
    // written in full by the kernel next: large ones offered huge pages, as the torch
    // binding does (not quantize's weights: bench/CPU_NOTES.md 64)
    if (!w.cuda) pg::cpu::advise_new_output(r.fresh->data, size_t(rows) * size_t(n) * pg::dtype_size(dt));
  }
  return r;
}

nb::object gemm(nb::handle a_obj, const Array& a, const Array& b, std::optional<Array> bias,
                const std::string& act, bool bf16_bits, uintptr_t stream, std::optional<nb::handle> out_obj) {
  const Where w = same_place({{&a, "a"}, {&b, "b"}, {bias ? &*bias : nullptr, "bias"}});
  pg::GemmArgs args;
  const pg::DType dt = float_dtype(a, "a", bf16_bits);
  args.a = matrix(a, "a", dt);
  args.b = matrix(b, "b", float_dtype(b, "b", bf16_bits));
  if (args.b.dtype != dt) throw nb::type_error("b must have the same dtype as a");
  Result out = epilogue_and_output(args, &pg::GemmArgs::c, args.a.rows, args.b.cols, bias, act, dt, w, "a",
                                   bf16_bits, out_obj, {{&a, "a"}, {&b, "b"}, {bias ? &*bias : nullptr, "bias"}});
  check(pg::validate_gemm(args));
  run(args, w, stream, &pg::cpu::gemm, &pg::cuda::gemm);
  return out.to_python(a_obj, bf16_bits);
}

int64_t group_code(std::optional<int64_t> g) {
  if (!g) return 0;
  if (*g <= 0) throw nb::value_error("group_size must be None (per channel) or positive");
  return *g;
}

nb::tuple quantize_weight(nb::handle w_obj, const Array& w, int bits, std::optional<int64_t> group_size,
                          bool bf16_bits, uintptr_t stream) {
  const Where where = same_place({{&w, "weight"}});
  pg::QuantizeArgs args;
  const pg::DType dt = float_dtype(w, "weight", bf16_bits);
  args.w = matrix(w, "weight", dt);
  args.bits = bits;
  args.group_size = group_code(group_size);
  if (bits != 4 && bits != 8) throw nb::value_error("bits must be 4 or 8");
  const size_t n = args.w.rows, k = args.w.cols;
  if (args.group_size && k % args.group_size) throw nb::value_error("group_size must divide K");
  if (bits == 4 && k % 2) throw nb::value_error("int4 needs an even K");
  Output q({n, bits == 8 ? k : k / 2}, bits == 8 ? pg::DType::i8 : pg::DType::u8, where);
  Output s = args.group_size ? Output({n, k / args.group_size}, dt, where) : Output({n}, dt, where);
  args.qweight = q.data;
  args.scales = s.data;
  args.scales_dtype = dt;
  check(pg::validate_quantize(args));
  run(args, where, stream, &pg::cpu::quantize, &pg::cuda::quantize);
  nb::object qo = q.to_python(w_obj, bf16_bits);
  return nb::make_tuple(qo, s.to_python(w_obj, bf16_bits));
}

nb::object mixed_linear(nb::handle x_obj, const Array& x, const Array& qweight, const Array& scales, int bits,
                        std::optional<int64_t> group_size, std::optional<Array> bias, const std::string& act,
                        bool bf16_bits, uintptr_t stream, std::optional<nb::handle> out_obj) {
  const Where w = same_place({{&x, "x"}, {&qweight, "qweight"}, {&scales, "scales"}, {bias ? &*bias : nullptr, "bias"}});
  pg::MixedLinearArgs args;
  const pg::DType dt = float_dtype(x, "x", bf16_bits);
  args.x = matrix(x, "x", dt);
  if (bits != 4 && bits != 8) throw nb::value_error("bits must be 4 or 8");
  const auto want_q = bits == 8 ? nb::dtype<int8_t>() : nb::dtype<uint8_t>();
  if (qweight.dtype() != want_q)
    throw nb::type_error((std::string("qweight must be ") + (bits == 8 ? "int8" : "uint8") + " for bits=" +
                          std::to_string(bits) + ", got " + dtype_label(qweight.dtype())).c_str());
  if (qweight.ndim() != 2 || (qweight.stride(1) != 1 && qweight.shape(0) * qweight.shape(1) > 0))
    throw nb::value_error("qweight must be 2-D with contiguous rows (as quantize_weight returns it)");
  args.w.data = qweight.data();
  args.w.n = qweight.shape(0);
  args.w.k = args.x.cols;
  args.w.row_stride = qweight.stride(0);
  args.w.bits = bits;
  args.w.group_size = group_code(group_size);
  args.w.scales = scales.data();
  args.w.scales_dtype = float_dtype(scales, "scales", bf16_bits);
  const size_t want_ndim = args.w.group_size ? 2 : 1;
  const bool shape_ok = scales.ndim() == want_ndim && scales.shape(0) == (size_t)args.w.n &&
                        (want_ndim == 1 || (args.w.group_size && scales.shape(1) == (size_t)(args.x.cols / args.w.group_size)));
  if (!shape_ok || (want_ndim == 2 && scales.stride(1) != 1 && scales.shape(1) > 1)) {
    std::string got = "[";
    for (size_t d = 0; d < scales.ndim(); ++d) got += (d ? ", " : "") + std::to_string(scales.shape(d));
    got += "]";
    const std::string n = std::to_string(args.w.n);
    throw nb::value_error(
        (args.w.group_size ? "scales must be [N, K / group_size] = [" + n + ", " +
                                 std::to_string(args.x.cols / args.w.group_size) + "] with contiguous rows, got " + got
                           : "scales must be 1-D [N] = [" + n + "] for per-channel quantisation, got " + got)
            .c_str());
  }
  args.w.scales_row_stride = scales.stride(0);
  if ((bits == 8 ? qweight.shape(1) : 2 * qweight.shape(1)) != (size_t)args.x.cols)
    throw nb::value_error("qweight does not match x's K (int4: [N, K/2])");
  Result out = epilogue_and_output(args, &pg::MixedLinearArgs::y, args.x.rows, args.w.n, bias, act, dt, w, "x",
                                   bf16_bits, out_obj,
                                   {{&x, "x"}, {&qweight, "qweight"}, {&scales, "scales"}, {bias ? &*bias : nullptr, "bias"}});
  check(pg::validate_mixed_linear(args));
  // CUDA: the torch binding's paths, with the scratch they need from the device's memory pool
  run(args, w, stream, &pg::cpu::mixed_linear, &pg::cuda::mixed_linear_pooled);
  return out.to_python(x_obj, bf16_bits);
}

// The door's errors begin with the function as Python reaches it, like the torch ops' errors
// ("portable_gemm.dlpack.gemm: b must ..."; a vendored copy's module name instead, set by
// dlpack.py at import through _set_error_prefix).
std::string& error_prefix() {
  static std::string prefix = "portable_gemm.dlpack.";
  return prefix;
}

// `checks`: how the kernel library's checks name the function ("gemm: a.cols (K) must ..."),
// dropped from their messages so that the name comes once.
template <class F>
auto named(const char* fn, const char* checks, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const nb::builtin_exception& e) {
    std::string what = e.what();
    const std::string theirs = std::string(checks) + ": ";
    if (what.compare(0, theirs.size(), theirs) == 0) what.erase(0, theirs.size());
    throw nb::builtin_exception(e.type(), (error_prefix() + fn + ": " + what).c_str());
  }
}

}  // namespace

NB_MODULE(_dlpack, m) {
  find_is_finalizing();
  m.doc() = "Torch-free door to the portable_gemm kernels (CPU and CUDA arrays via DLPack / buffer protocol).";
  m.def("has_cuda", [] { return pg::has_cuda(); },
        "Whether this build has the CUDA kernels (not whether a GPU is present).");
  m.def("gemm",
        [](nb::handle a_obj, nb::handle b_obj, std::optional<nb::handle> bias_obj, const std::string& act,
           bool bf16_bits, uintptr_t stream, std::optional<nb::handle> out_obj) {
          return named("gemm", "gemm", [&] {
            Array a = as_array(a_obj, "a"), b = as_array(b_obj, "b");
            std::optional<Array> bias;
            if (bias_obj && !bias_obj->is_none()) bias = as_array(*bias_obj, "bias");
            if (out_obj && out_obj->is_none()) out_obj.reset();
            return gemm(a_obj, a, b, bias, act, bf16_bits, stream, out_obj);
          });
        },
        nb::arg("a"), nb::arg("b"), nb::arg("bias").none() = nb::none(), nb::arg("activation") = "none",
        nb::arg("bf16_bits") = false, nb::arg("stream") = 0, nb::arg("out").none() = nb::none());
  m.def("quantize_weight",
        [](nb::handle w_obj, int bits, std::optional<int64_t> group_size, bool bf16_bits, uintptr_t stream) {
          return named("quantize_weight", "quantize", [&] {
            return quantize_weight(w_obj, as_array(w_obj, "weight"), bits, group_size, bf16_bits, stream);
          });
        },
        nb::arg("weight"), nb::arg("bits"), nb::arg("group_size").none() = nb::none(),
        nb::arg("bf16_bits") = false, nb::arg("stream") = 0);
  m.def("mixed_linear",
        [](nb::handle x_obj, nb::handle q_obj, nb::handle s_obj, int bits, std::optional<int64_t> group_size,
           std::optional<nb::handle> bias_obj, const std::string& act, bool bf16_bits, uintptr_t stream,
           std::optional<nb::handle> out_obj) {
          return named("mixed_linear", "mixed_linear", [&] {
            std::optional<Array> bias;
            if (bias_obj && !bias_obj->is_none()) bias = as_array(*bias_obj, "bias");
            if (out_obj && out_obj->is_none()) out_obj.reset();
            return mixed_linear(x_obj, as_array(x_obj, "x"), as_array(q_obj, "qweight"), as_array(s_obj, "scales"),
                                bits, group_size, bias, act, bf16_bits, stream, out_obj);
          });
        },
        nb::arg("x"), nb::arg("qweight"), nb::arg("scales"), nb::arg("bits"),
        nb::arg("group_size").none() = nb::none(), nb::arg("bias").none() = nb::none(),
        nb::arg("activation") = "none", nb::arg("bf16_bits") = false, nb::arg("stream") = 0,
        nb::arg("out").none() = nb::none());
  m.def("_set_error_prefix", [](const std::string& prefix) { error_prefix() = prefix; },
        "Sets what the door's error messages begin with (dlpack.py: its module name and a dot).");
  m.def("build_info", [] { return std::string(pg::build_info()); },
        "The kernel library's build in one line: version, compiler, CUDA toolkit and archs.");
  m.def("cpu_isa", [] { return std::string(pg::cpu::isa()); },
        "The CPU units the kernels use (avx512+bf16, ...; PORTABLE_GEMM_ISA lowers them).");
  m.def("cpu_avx2_dq", [] { return std::string(pg::cpu::avx2_dq_path()); },
        "On the AVX2 kernels, which rows of x weight-only dequantises once per weight row, and "
        "why (PORTABLE_GEMM_AVX2_DQ, the core); empty under other units.");
  m.def("cpu_scratch_bytes", [] { return portable_gemm_cpu_scratch_bytes(); },
        "Bytes the CPU kernels' per-thread scratch buffers hold now.");
  m.def("release_cpu_scratch", [] { return portable_gemm_release_cpu_scratch(); },
        nb::call_guard<nb::gil_scoped_release>(),
        "Frees the scratch of every thread not inside a call now; returns the bytes freed.");
}

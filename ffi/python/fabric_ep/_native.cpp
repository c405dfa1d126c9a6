// fabric_ep's optional torch helper: the torch calls of a GPU dispatch/combine that cost the
// most from Python (allocating the outputs, record_stream, reading the inputs' dtype, device,
// shape, layout and data_ptr), made in one call each.
//
// Built on first use by fabric_ep/_native.py (torch.utils.cpp_extension.load) and imported as
// the module `fabric_ep_native`; the pure-Python path stays when it cannot be built.
//
// NOTES (why): from Python every torch call pays its argument parsing and a dispatcher trip
// (an allocation ~1.7 us, a record_stream ~0.9 us on the H200 host: bench_torch_alloc.py); a
// dispatch makes three or four allocations and, with async_finish, six to eight
// record_streams. Here each is a C++ call of the same torch operator (at::empty_strided,
// Tensor::record_stream), so the semantics are torch's own. The logic (what is allocated on
// which stream, what is recorded where) stays in fabric_ep/_gpu.py; this file only batches.
//
// NOTES (GIL): the torch work runs with the GIL released, as torch's own Python bindings do:
// an allocation may cudaMalloc (which synchronises the device) and the allocator's lock may be
// held by a thread doing so; with ranks as threads of one process a peer must be able to take
// the GIL meanwhile to launch the kernel this rank's device waits for.

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Exceptions.h>

#include <ATen/ops/empty_strided.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <exception>
#include <vector>

namespace {

// The ABI of this module as _native.py expects it (a mismatch: _native.py refuses the module).
constexpr long kAbi = 2;
// The most tensors or dimensions one call takes (a dispatch returns four tensors, a shape has
// at most three dimensions).
constexpr Py_ssize_t kMaxDims = 8;

// A stream argument: a torch stream id (torch.Stream.stream_id, e.g. of the Buffer's
// torch.cuda.ExternalStream) on the tensor's CUDA device, or 0 for that device's current
// stream. Streams are torch's device-generic c10::Stream, so this file needs no CUDA header.
bool stream_arg(PyObject* o, const char* what, int64_t* out) {
  if (!PyLong_Check(o)) {
    PyErr_Format(PyExc_TypeError, "%s: expected an int (a torch stream_id, 0 for the current stream)",
                 what);
    return false;
  }
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) return false;
  *out = v;
  return true;
}

c10::Stream stream_for(int64_t id, c10::DeviceIndex dev) {
  if (id == 0) {
    return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA)
        .getStream(c10::Device(c10::DeviceType::CUDA, dev));
  }
  return c10::Stream::unpack3(id, dev, c10::DeviceType::CUDA);
}

bool int_tuple(PyObject* o, const char* what, Py_ssize_t i, std::vector<int64_t>* out) {
  if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) > kMaxDims) {
    PyErr_Format(PyExc_TypeError, "empty: %s of output %zd: expected a tuple of at most %zd ints",
                 what, i, kMaxDims);
    return false;
  }
  out->clear();
  for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(o); ++j) {
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(o, j));
    if (v == -1 && PyErr_Occurred()) return false;
    out->push_back(v);
  }
  return true;
}

// empty(stream, like, shape, strides, like, shape, strides, ...) -> tuple of tensors (the
// device of the first `like`; all on one device).
// Each output is at::empty_strided(shape, strides) with `like`'s dtype and device (as
// `like.new_empty_strided(shape, strides)`), allocated while `stream` is the current stream of
// that device (so from that stream's pool of torch's caching allocator).
PyObject* empty(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n < 4 || (n - 1) % 3 != 0 || (n - 1) / 3 > kMaxDims) {
    PyErr_SetString(PyExc_TypeError,
                    "empty(stream, like, shape, strides, ...): expected a stream and 1 to 8 "
                    "(like, shape, strides) triples");
    return nullptr;
  }
  int64_t sid = 0;
  if (!stream_arg(args[0], "empty: stream", &sid)) return nullptr;
  const Py_ssize_t outs = (n - 1) / 3;
  std::vector<at::TensorOptions> opts;
  std::vector<std::vector<int64_t>> shapes(outs), strides(outs);
  opts.reserve(outs);
  for (Py_ssize_t i = 0; i < outs; ++i) {
    PyObject* like = args[1 + 3 * i];
    if (!THPVariable_Check(like)) {
      PyErr_Format(PyExc_TypeError, "empty: like of output %zd: expected a torch.Tensor", i);
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(like);
    if (!t.is_cuda()) {
      PyErr_Format(PyExc_ValueError, "empty: like of output %zd: expected a CUDA tensor", i);
      return nullptr;
    }
    if (i > 0 && t.device() != opts[0].device()) {
      PyErr_Format(PyExc_ValueError, "empty: like of output %zd: on another device than output 0",
                   i);
      return nullptr;
    }
    opts.push_back(t.options());
    if (!int_tuple(args[2 + 3 * i], "shape", i, &shapes[i]) ||
        !int_tuple(args[3 + 3 * i], "strides", i, &strides[i]))
      return nullptr;
    if (shapes[i].size() != strides[i].size()) {
      PyErr_Format(PyExc_ValueError, "empty: output %zd: shape and strides differ in length", i);
      return nullptr;
    }
  }
  std::vector<at::Tensor> made;
  made.reserve(outs);
  std::exception_ptr err;
  Py_BEGIN_ALLOW_THREADS
  try {
    const c10::DeviceIndex dev = opts[0].device().index();
    c10::StreamGuard guard(stream_for(sid, dev));
    for (Py_ssize_t i = 0; i < outs; ++i)
      made.push_back(at::empty_strided(shapes[i], strides[i], opts[i]));
  } catch (...) {
    err = std::current_exception();
  }
  Py_END_ALLOW_THREADS
  if (err) std::rethrow_exception(err);  // HANDLE_TH_ERRORS turns it into torch's exception
  PyObject* tup = PyTuple_New(outs);
  if (tup == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < outs; ++i) {
    PyObject* w = THPVariable_Wrap(std::move(made[i]));
    if (w == nullptr) {
      Py_DECREF(tup);
      return nullptr;
    }
    PyTuple_SET_ITEM(tup, i, w);
  }
  return tup;
  END_HANDLE_TH_ERRORS
}

// record(stream, tensors, stream, tensors, ...) -> None. Every tensor of each tuple (None
// entries skipped) is Tensor.record_stream'ed on its stream (0: the current stream of the
// tensor's device).
PyObject* record(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n < 2 || n % 2 != 0) {
    PyErr_SetString(PyExc_TypeError,
                    "record(stream, tensors, ...): expected (stream, tuple of tensors) pairs");
    return nullptr;
  }
  std::vector<std::pair<int64_t, at::Tensor>> todo;
  for (Py_ssize_t p = 0; p < n; p += 2) {
    int64_t sid = 0;
    if (!stream_arg(args[p], "record: stream", &sid)) return nullptr;
    PyObject* ts = args[p + 1];
    if (!PyTuple_Check(ts)) {
      PyErr_Format(PyExc_TypeError, "record: argument %zd: expected a tuple of tensors", p + 1);
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ts); ++i) {
      PyObject* o = PyTuple_GET_ITEM(ts, i);
      if (o == Py_None) continue;
      if (!THPVariable_Check(o)) {
        PyErr_Format(PyExc_TypeError, "record: argument %zd, item %zd: expected a torch.Tensor",
                     p + 1, i);
        return nullptr;
      }
      todo.emplace_back(sid, THPVariable_Unpack(o));
    }
  }
  std::exception_ptr err;
  Py_BEGIN_ALLOW_THREADS
  try {
    for (auto& [sid, t] : todo) {
      TORCH_CHECK(t.is_cuda(), "record: a tensor on ", t.device(), ", expected a CUDA tensor");
      t.record_stream(stream_for(sid, t.device().index()));
    }
  } catch (...) {
    err = std::current_exception();
  }
  Py_END_ALLOW_THREADS
  if (err) std::rethrow_exception(err);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// ptrs(dev, t, like, rows, cols, t, like, rows, cols, ...) -> (data_ptr, ..., rows of the
// first) or None. Each t must be exactly a torch.Tensor (no subclass; torch counts an
// nn.Parameter as exact, and so do the Python checks' isinstance), on CUDA device `dev`, 2-D,
// contiguous, of `like`'s dtype, with size(1) == cols and size(0) == rows (rows -1: any,
// for the first only; -2: the first tensor's rows). None when any is not: the caller's own
// checks then say what is wrong (this is the common case's fast path, not a validator).
PyObject* ptrs(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n < 5 || (n - 1) % 4 != 0 || (n - 1) / 4 > kMaxDims) {
    PyErr_SetString(PyExc_TypeError,
                    "ptrs(dev, t, like, rows, cols, ...): expected a device and 1 to 8 "
                    "(tensor, like, rows, cols) quadruples");
    return nullptr;
  }
  const long dev = PyLong_AsLong(args[0]);
  if (dev == -1 && PyErr_Occurred()) return nullptr;
  const Py_ssize_t count = (n - 1) / 4;
  long long rows[kMaxDims], cols[kMaxDims];
  for (Py_ssize_t i = 0; i < count; ++i) {  // the spec first, whatever the tensors are
    PyObject* const* q = args + 1 + 4 * i;
    if (!THPVariable_Check(q[1])) {
      PyErr_Format(PyExc_TypeError, "ptrs: like of tensor %zd: expected a torch.Tensor", i);
      return nullptr;
    }
    rows[i] = PyLong_AsLongLong(q[2]);
    if (rows[i] == -1 && PyErr_Occurred()) return nullptr;
    cols[i] = PyLong_AsLongLong(q[3]);
    if (cols[i] == -1 && PyErr_Occurred()) return nullptr;
    if (rows[i] < -2 || (i == 0 && rows[i] == -2) || (i > 0 && rows[i] == -1)) {
      PyErr_Format(PyExc_ValueError,
                   "ptrs: rows of tensor %zd: %lld (-1: any, first only; -2: the first's)", i,
                   rows[i]);
      return nullptr;
    }
  }
  uintptr_t got[kMaxDims];
  int64_t first_rows = -1;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* const* q = args + 1 + 4 * i;
    if (!THPVariable_CheckExact(q[0])) Py_RETURN_NONE;
    const at::Tensor& t = THPVariable_Unpack(q[0]);
    if (!t.defined() || !t.is_cuda() || t.get_device() != dev || t.dim() != 2 ||
        t.scalar_type() != THPVariable_Unpack(q[1]).scalar_type() || t.size(1) != cols[i] ||
        !t.is_contiguous())
      Py_RETURN_NONE;
    const int64_t r = t.size(0);
    if (i == 0) first_rows = r;
    const long long want = rows[i] == -2 ? first_rows : rows[i];
    if (want >= 0 && r != want) Py_RETURN_NONE;
    got[i] = reinterpret_cast<uintptr_t>(t.data_ptr());
  }
  PyObject* tup = PyTuple_New(count + 1);
  if (tup == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i <= count; ++i) {
    PyObject* v = i < count ? PyLong_FromUnsignedLongLong(got[i]) : PyLong_FromLongLong(first_rows);
    if (v == nullptr) {
      Py_DECREF(tup);
      return nullptr;
    }
    PyTuple_SET_ITEM(tup, i, v);
  }
  return tup;
  END_HANDLE_TH_ERRORS
}

PyMethodDef kMethods[] = {
    {"empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty)), METH_FASTCALL,
     "empty(stream, like, shape, strides, ...): tensors allocated on stream (0: current)"},
    {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record)), METH_FASTCALL,
     "record(stream, tensors, ...): Tensor.record_stream of each tensor on its stream"},
    {"ptrs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(ptrs)), METH_FASTCALL,
     "ptrs(dev, t, like, rows, cols, ...): the tensors' data_ptrs and rows, or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "fabric_ep_native",
                       "fabric_ep's optional torch helper (see fabric_ep/_native.py)", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_fabric_ep_native(void) {
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  if (PyModule_AddIntConstant(m, "ABI", kAbi) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}

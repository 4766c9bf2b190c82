// The torch fast paths' per-call work in C++, on the at::Tensor behind each Python tensor.
//
// prints(*tensors) -> (pointers, fingerprint) or None: the fingerprints of plan.prints3, Plan and
// tiledispatch.torch's call keys, without Python's seven attribute reads per tensor. An argument is a torch.Tensor
// or torch.nn.Parameter (not a subclass: a subclass may redefine what its attributes mean) or None. The fingerprint
// is a bytes object holding, per argument, everything the full checks read: ndim, sizes, strides, dtype, device
// type and index, the pointer's alignment, requires_grad and the lazy negation and conjugation bits (None: one
// entry, -1). None comes back for anything else (a subclass, a sparse or storage-less tensor, too many dimensions):
// the caller then takes the Python path, whose fingerprints are tuples and so never equal these.
//
// empty_like_on(prototype, like) -> (tensor, pointer) or None: a new tensor with the prototype's sizes, strides and
// dtype (a meta tensor: no memory) on like's device, as torch.empty_strided makes it, without Python's argument
// parsing. None when the allocation fails: the caller's torch.empty_strided then raises torch's own error (e.g.
// torch.OutOfMemoryError).
#include <Python.h>

#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorOptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

constexpr Py_ssize_t kMaxArgs = 8;
constexpr int64_t kMaxDims = 12;
constexpr int64_t kNone = -1;  // a None argument's entry; a tensor's entry starts with its ndim (>= 0)

// Appends t's fingerprint at out (room for 8 + 2 * kMaxDims entries) and sets ptr; false: not a tensor this
// function reads (the Python path decides).
bool read(const at::Tensor& t, int64_t* out, int64_t& used, uintptr_t& ptr) {
  if (t.layout() != at::kStrided || !t.has_storage() || t.dim() > kMaxDims) return false;
  const int64_t ndim = t.dim();
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  const at::Device device = t.device();
  ptr = device.is_meta() ? 0 : reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t n = 0;
  out[n++] = ndim;
  for (int64_t i = 0; i < ndim; ++i) out[n++] = sizes[i];
  for (int64_t i = 0; i < ndim; ++i) out[n++] = strides[i];
  out[n++] = static_cast<int64_t>(t.scalar_type());
  out[n++] = static_cast<int64_t>(device.type());
  out[n++] = device.index();
  out[n++] = ptr ? static_cast<int64_t>(ptr & 15) : -1;  // -1: no memory (as the Python fingerprint says)
  out[n++] = t.requires_grad();
  out[n++] = t.is_neg();
  out[n++] = t.is_conj();
  used = n;
  return true;
}

// (first, second), taking over both references; nullptr (an exception set) when either is nullptr or the tuple
// cannot be made.
PyObject* pair(PyObject* first, PyObject* second) {
  PyObject* result = first && second ? PyTuple_Pack(2, first, second) : nullptr;
  Py_XDECREF(first);
  Py_XDECREF(second);
  return result;
}

PyObject* prints(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs > kMaxArgs) Py_RETURN_NONE;
  int64_t buffer[kMaxArgs * (8 + 2 * kMaxDims)];
  uintptr_t ptrs[kMaxArgs];
  int64_t filled = 0;
  try {
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      PyObject* arg = args[i];
      if (arg == Py_None) {
        buffer[filled++] = kNone;
        ptrs[i] = 0;
        continue;
      }
      if (!THPVariable_CheckExact(arg)) Py_RETURN_NONE;
      int64_t used = 0;
      if (!read(THPVariable_Unpack(arg), buffer + filled, used, ptrs[i])) Py_RETURN_NONE;
      filled += used;
    }
  } catch (...) {  // an accessor that refused (e.g. no data): the Python path reads it and says what is wrong
    Py_RETURN_NONE;
  }
  PyObject* pointers = PyTuple_New(nargs);
  if (pointers == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    PyObject* value = args[i] == Py_None ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(ptrs[i]);
    if (value == nullptr) {
      Py_DECREF(pointers);
      return nullptr;
    }
    PyTuple_SET_ITEM(pointers, i, value);
  }
  return pair(pointers, PyBytes_FromStringAndSize(reinterpret_cast<const char*>(buffer), filled * sizeof(int64_t)));
}

PyObject* empty_like_on(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1])) Py_RETURN_NONE;
  try {
    const at::Tensor& prototype = THPVariable_Unpack(args[0]);
    const at::Tensor& like = THPVariable_Unpack(args[1]);
    at::Tensor made = at::empty_strided(prototype.sizes(), prototype.strides(),
                                        at::TensorOptions().dtype(prototype.scalar_type()).device(like.device()));
    const auto ptr = reinterpret_cast<uintptr_t>(made.data_ptr());
    return pair(THPVariable_Wrap(std::move(made)), PyLong_FromUnsignedLongLong(ptr));
  } catch (...) {
    Py_RETURN_NONE;
  }
}

PyMethodDef methods[] = {
    {"prints", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(prints)), METH_FASTCALL,
     "prints(*tensors) -> (pointers, fingerprint bytes), or None for an argument this reader does not take"},
    {"empty_like_on", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty_like_on)), METH_FASTCALL,
     "empty_like_on(meta prototype, like) -> (new tensor on like's device, its data pointer), or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_td_torch_fastpath", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__td_torch_fastpath() { return PyModule_Create(&module); }

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
// eager_prints(*tensors): prints, or None also when a call on these tensors may not run its implementation
// directly: a torch dispatch or function mode, the JIT tracer, the autograd profiler, or autocast on the first
// tensor's device (tiledispatch.torch._eager's checks but two that Python asks: the compiler's, and functorch's,
// whose header needs a library torch does not ship).
//
// launcher(run, args, reason, reason_bytes, sources, written, written_span, reads, exact, align) -> a launch record
// of a prepared Plan (Plan.launch_layout), and launch(record, prototype, like, pointers, stream): the eager
// operators' remembered call in one step. It allocates the output (the sizes, strides and dtype of prototype, a
// meta tensor, on like's device, as torch.empty_strided makes it), fills each td_args slot from the caller's
// pointers (sources: per slot, an index into pointers, kOut for the output, kAbsent for none), checks that the
// output overlaps no read tensor, sets the stream (None: left as it is), and calls td_run without the GIL, as ctypes
// calls it. It returns the output; None when nothing was launched because the output's alignment
// differs from the validated one or the allocation failed (the caller takes the full path); else an int: td_run's
// status, or kOverlap (the caller's Python path says what is wrong). More than 8 pointers: None, nothing allocated.
//
// record(forward, backward, backward_once, spec, name, *inputs) -> output: a differentiable call whose forward and
// backward passes are Python functions, recorded in the autograd graph by a C++ node. torch.autograd.Function does
// the same with a Python context object and node, which cost more host time than the remembered launches they wrap
// (README, "How a gradient call is recorded"). With grad mode and autocast off (the caller cast the inputs), it
// calls forward(spec, *inputs) -> (output, saved): a new tensor, and the tensors (or None) the backward pass needs,
// the output among them by identity. A node named `name` then takes the inputs' gradient edges; its backward pass
// calls backward((saved, spec, needs), grad) -> one gradient (or None) per input, needs saying which inputs want
// one, or backward_once where grad mode is on in the backward pass (create_graph=True). Saved tensors are checked
// for in-place changes when the backward pass reads them, as save_for_backward's are. Inputs: tensors or None.
// forward may also return a third item, a link: an object passed to backward as the state's fourth item, whose
// attribute native_backward may hold a backward plan.
//
// backward_plan(thread, data_call, data_print, weight_call, weight_print, needs_x, needs_w, needs_bias) -> a plan
// of a conv's backward pass as two remembered calls (tiledispatch.torch's _FastCall; None where that gradient is
// not wanted) and the fingerprints of (dY, W, None) and (X, dY, None) they were remembered under. A node whose
// link carries one runs it instead of the Python backward function where the call is the one it was made for:
// the same thread, the same gradients wanted, grad mode off, nothing that may intercept, saved (x, w, None, None),
// and dY (made channels-last, as the Python function makes it) with x and w printing as planned. It launches dX
// and dW as those calls' native path does (the same checks of their plan's arguments and scalars) and sums dY for
// the bias gradient; anything else unusual, and the Python function runs (it says what is wrong). This is the
// Python function's work, one node call without Python, on the backward pass of every conv a model trains.
#include <Python.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/profiler/api.h>

#include "tiledispatch_abi.h"

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

// Whether nothing (a mode, the tracer, the profiler, autocast) may intercept a call on first.
bool plain_eager(const at::Tensor& first) {
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !at::impl::torch_function_mode_enabled() &&
         !torch::jit::tracer::isTracing() &&
         !torch::profiler::impl::profilerEnabled() &&
         !at::autocast::is_autocast_enabled(first.device().type());
}

bool plain_eager(PyObject* first) {
  return THPVariable_CheckExact(first) && plain_eager(THPVariable_Unpack(first));
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

PyObject* eager_prints(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs == 0 || !plain_eager(args[0])) Py_RETURN_NONE;
  } catch (...) {
    Py_RETURN_NONE;
  }
  return prints(self, args, nargs);
}

// -- the remembered call's launch ------------------------------------------------------------------------------
constexpr long kOut = -2, kAbsent = -1;  // a slot's source: the new output, or no tensor
constexpr long kOverlap = -1000;        // launch's result when the output overlaps a read tensor
constexpr const char* kRecord = "tiledispatch.launch_record";

using RunFunction = int32_t (*)(const td_args*, char*, uint64_t);

struct ReadSpan {
  long slot;
  int64_t lo, hi;  // bytes relative to the slot's pointer
};

struct LaunchRecord {
  RunFunction run;
  td_args* args;
  char* reason;
  uint64_t reason_bytes;
  long slots;
  long sources[TD_MAX_TENSORS];
  long written, exact;  // exact: the read slot that may alias the output exactly (-1: none)
  int64_t written_lo, written_hi;
  long reads;
  ReadSpan read[TD_MAX_TENSORS];
  uintptr_t align;
};

void free_record(PyObject* capsule) { delete static_cast<LaunchRecord*>(PyCapsule_GetPointer(capsule, kRecord)); }

bool read_ints(PyObject* sequence, long count, int64_t* out) {  // count ints from a tuple
  if (!PyTuple_Check(sequence) || PyTuple_GET_SIZE(sequence) != count) return false;
  for (long i = 0; i < count; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(sequence, i));
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

PyObject* launcher(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "launcher takes 10 arguments");
    return nullptr;
  }
  auto record = std::make_unique<LaunchRecord>();
  record->run = reinterpret_cast<RunFunction>(PyLong_AsVoidPtr(args[0]));
  record->args = static_cast<td_args*>(PyLong_AsVoidPtr(args[1]));
  record->reason = static_cast<char*>(PyLong_AsVoidPtr(args[2]));
  record->reason_bytes = PyLong_AsUnsignedLongLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  const Py_ssize_t slots = PyTuple_Check(args[4]) ? PyTuple_GET_SIZE(args[4]) : -1;
  const Py_ssize_t reads = PyTuple_Check(args[7]) ? PyTuple_GET_SIZE(args[7]) : -1;
  int64_t values[TD_MAX_TENSORS], span[3];
  bool ok = slots >= 0 && slots <= TD_MAX_TENSORS && reads >= 0 && reads <= TD_MAX_TENSORS &&
            read_ints(args[4], slots, values);
  record->slots = slots;
  for (long i = 0; ok && i < slots; ++i) record->sources[i] = values[i];
  record->written = PyLong_AsLong(args[5]);
  ok = ok && read_ints(args[6], 2, span);
  record->written_lo = span[0];
  record->written_hi = span[1];
  record->reads = reads;
  for (long i = 0; ok && i < reads; ++i) {
    ok = read_ints(PyTuple_GET_ITEM(args[7], i), 3, span);
    record->read[i] = {static_cast<long>(span[0]), span[1], span[2]};
    ok = ok && span[0] >= 0 && span[0] < slots;
  }
  record->exact = PyLong_AsLong(args[8]);
  record->align = PyLong_AsUnsignedLong(args[9]);
  ok = ok && !PyErr_Occurred() && record->run && record->args && record->reason && record->written >= 0 &&
       record->written < slots;
  if (!ok) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "launcher: malformed launch layout");
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(record.get(), kRecord, free_record);
  if (capsule) record.release();
  return capsule;
}

constexpr int32_t kNotLaunched = -2000, kFewPointers = -2001;  // launch_into: None, and a malformed call

// The remembered call's launch (see launch): TD_OK with made set, kNotLaunched (the caller's full path decides),
// kFewPointers, kOverlap or td_run's status. caller: the given pointers (0 for None).
int32_t launch_into(const LaunchRecord* record, const at::Tensor& prototype, const at::Device device,
                    const uintptr_t* caller, Py_ssize_t given, void* stream, at::Tensor& made) {
  try {
    made = at::empty_strided(prototype.sizes(), prototype.strides(),
                             at::TensorOptions().dtype(prototype.scalar_type()).device(device));
  } catch (...) {
    return kNotLaunched;
  }
  const auto out = reinterpret_cast<uintptr_t>(made.data_ptr());
  if ((out & 15) != record->align) return kNotLaunched;
  uintptr_t slot[TD_MAX_TENSORS];
  for (long i = 0; i < record->slots; ++i) {
    const long source = record->sources[i];
    if (source >= given) return kFewPointers;
    slot[i] = source == kOut ? out : source == kAbsent ? 0 : caller[source];
  }
  const uintptr_t w = slot[record->written];
  const intptr_t w_lo = static_cast<intptr_t>(w) + record->written_lo;
  const intptr_t w_hi = static_cast<intptr_t>(w) + record->written_hi;
  for (long i = 0; i < record->reads; ++i) {
    const ReadSpan& r = record->read[i];
    const auto p = static_cast<intptr_t>(slot[r.slot]);
    if (p && p + r.lo < w_hi && w_lo < p + r.hi && !(r.slot == record->exact && slot[r.slot] == w)) return kOverlap;
  }
  for (long i = 0; i < record->slots; ++i) record->args->tensors[i].data = reinterpret_cast<void*>(slot[i]);
  record->args->stream = stream;
  int32_t status;
  Py_BEGIN_ALLOW_THREADS
  status = record->run(record->args, record->reason, record->reason_bytes);
  Py_END_ALLOW_THREADS
  return status;
}

PyObject* launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyTuple_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "launch(record, prototype, like, pointers: tuple, stream)");
    return nullptr;
  }
  if (!PyCapsule_IsValid(args[0], kRecord)) {
    PyErr_SetString(PyExc_TypeError, "launch: the first argument is not a launch record (launcher's result)");
    return nullptr;
  }
  const auto* record = static_cast<const LaunchRecord*>(PyCapsule_GetPointer(args[0], kRecord));
  const Py_ssize_t given = PyTuple_GET_SIZE(args[3]);
  uintptr_t caller[kMaxArgs];
  if (given > kMaxArgs) Py_RETURN_NONE;  // more tensors than prints reads: the caller's Python path launches
  for (Py_ssize_t i = 0; i < given; ++i) {
    PyObject* p = PyTuple_GET_ITEM(args[3], i);
    caller[i] = p == Py_None ? 0 : PyLong_AsUnsignedLongLong(p);
  }
  void* stream = args[4] == Py_None ? record->args->stream : PyLong_AsVoidPtr(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (!THPVariable_CheckExact(args[1]) || !THPVariable_CheckExact(args[2])) Py_RETURN_NONE;
  at::Tensor made;
  const int32_t status = launch_into(record, THPVariable_Unpack(args[1]), THPVariable_Unpack(args[2]).device(),
                                     caller, given, stream, made);
  if (status == kNotLaunched) Py_RETURN_NONE;
  if (status == kFewPointers) {
    PyErr_SetString(PyExc_ValueError, "launch: the record expects more pointers");
    return nullptr;
  }
  if (status != TD_OK) return PyLong_FromLong(status);
  return THPVariable_Wrap(std::move(made));
}

// -- backward plans: a recorded conv's backward pass as remembered launches, without Python --------------------
constexpr const char* kBackwardPlan = "tiledispatch.backward_plan";

// Attribute names read from tiledispatch.torch's objects (made at import).
PyObject* kLauncherAttr;  // _FastCall.launcher
PyObject* kPlanAttr;      // Launcher.plan
PyObject* kArgsAttr;      // _FastCall.args
PyObject* kPlanArgsAttr;  // Plan._args
PyObject* kAlphaAttr;     // _FastCall.alpha and Launcher.alpha
PyObject* kBetaAttr;      // _FastCall.beta and Launcher.beta
PyObject* kRecordAttr;    // _FastCall.record
PyObject* kPrototypeAttr; // _FastCall.prototype
PyObject* kStreamOfAttr;  // Plan._stream_of
PyObject* kPtrsAttr;      // Plan._ptrs
PyObject* kNativeBackwardAttr;  // _FastCall.native_backward: the plan a recorded call's node runs, or None / False

struct PlannedLaunch {
  PyObject* call = nullptr;  // a remembered call (tiledispatch.torch._FastCall), owned; nullptr: not wanted
  std::string print;         // the fingerprint (prints) of its two operands and None, under which it was remembered
};

struct BackwardPlan {
  unsigned long thread;    // the thread its launches were remembered on (their keys hold it)
  PlannedLaunch data;      // dX from (dY, W)
  PlannedLaunch weight;    // dW from (X, dY)
  bool needs[3];           // the gradients it gives (x, w, bias), as the node's should_compute_output must ask
  ~BackwardPlan() {
    Py_XDECREF(data.call);
    Py_XDECREF(weight.call);
  }
};

void free_plan(PyObject* capsule) {
  delete static_cast<BackwardPlan*>(PyCapsule_GetPointer(capsule, kBackwardPlan));
}

// backward_plan(thread, data_call, data_print, weight_call, weight_print, needs_x, needs_w, needs_bias)
PyObject* backward_plan(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8 || !PyBytes_Check(args[2]) || !PyBytes_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "backward_plan(thread, data_call, data_print: bytes, weight_call, "
                                     "weight_print: bytes, needs_x, needs_w, needs_bias)");
    return nullptr;
  }
  auto plan = std::make_unique<BackwardPlan>();
  plan->thread = PyLong_AsUnsignedLong(args[0]);
  if (PyErr_Occurred()) return nullptr;
  PlannedLaunch* launches[2] = {&plan->data, &plan->weight};
  for (int i = 0; i < 2; ++i) {
    PyObject* call = args[1 + 2 * i];
    if (call != Py_None) launches[i]->call = Py_NewRef(call);
    launches[i]->print.assign(PyBytes_AS_STRING(args[2 + 2 * i]), PyBytes_GET_SIZE(args[2 + 2 * i]));
  }
  for (int i = 0; i < 3; ++i) plan->needs[i] = PyObject_IsTrue(args[5 + i]) == 1;
  if ((plan->needs[0] && !plan->data.call) || (plan->needs[1] && !plan->weight.call)) {
    PyErr_SetString(PyExc_ValueError, "backward_plan: a wanted gradient has no remembered call");
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(plan.get(), kBackwardPlan, free_plan);
  if (capsule) plan.release();
  return capsule;
}

// Whether prints(a, b, None) equals print (no Python objects made).
bool printed_as(const at::Tensor& a, const at::Tensor& b, const std::string& print) {
  int64_t buffer[3 * (8 + 2 * kMaxDims)];
  int64_t filled = 0, used = 0;
  uintptr_t ignored;
  if (!read(a, buffer, used, ignored)) return false;
  filled += used;
  if (!read(b, buffer + filled, used, ignored)) return false;
  filled += used;
  buffer[filled++] = kNone;
  return print.size() == filled * sizeof(int64_t) && std::memcmp(print.data(), buffer, print.size()) == 0;
}

// attribute `name` of object is `expected`'s attribute `name` (identity), both readable
bool same_attribute(PyObject* object, PyObject* other, PyObject* name, PyObject* other_name) {
  PyObject* a = PyObject_GetAttr(object, name);
  PyObject* b = a ? PyObject_GetAttr(other, other_name) : nullptr;
  const bool same = a && b && a == b;
  Py_XDECREF(a);
  Py_XDECREF(b);
  return same;
}

// A remembered call's launch on (a, b), as _FastCall.__call__ makes it on the native path: TD_OK with made set,
// else kNotLaunched where that call would not launch natively (its plan prepared since with other arguments or
// scalars) or anything else is unusual; the Python path then takes over and says what is wrong. With the GIL.
int32_t launch_planned(const PlannedLaunch& planned, const at::Tensor& like, uintptr_t a, uintptr_t b,
                       at::Tensor& made) {
  PyObject* call = planned.call;
  PyObject* launcher = PyObject_GetAttr(call, kLauncherAttr);
  PyObject* plan = launcher ? PyObject_GetAttr(launcher, kPlanAttr) : nullptr;
  PyObject* record = plan ? PyObject_GetAttr(call, kRecordAttr) : nullptr;
  PyObject* prototype = record ? PyObject_GetAttr(call, kPrototypeAttr) : nullptr;
  PyObject* stream_of = prototype ? PyObject_GetAttr(plan, kStreamOfAttr) : nullptr;
  PyObject* stream = nullptr;
  int32_t status = kNotLaunched;
  if (stream_of && PyCapsule_IsValid(record, kRecord) && THPVariable_CheckExact(prototype) &&
      same_attribute(plan, call, kPlanArgsAttr, kArgsAttr) && same_attribute(launcher, call, kAlphaAttr, kAlphaAttr) &&
      same_attribute(launcher, call, kBetaAttr, kBetaAttr)) {
    stream = stream_of == Py_None ? Py_NewRef(Py_None) : PyObject_CallNoArgs(stream_of);
    const auto* launch_record = static_cast<const LaunchRecord*>(PyCapsule_GetPointer(record, kRecord));
    void* raw_stream = stream == Py_None ? launch_record->args->stream : stream ? PyLong_AsVoidPtr(stream) : nullptr;
    if (stream && !PyErr_Occurred()) {
      const uintptr_t caller[3] = {a, b, 0};
      status = launch_into(launch_record, THPVariable_Unpack(prototype), like.device(), caller, 3, raw_stream, made);
      // the slots hold this launch's pointers: the plan's next launch writes its own (as _FastCall does)
      if (PyObject_SetAttr(plan, kPtrsAttr, Py_None) != 0) status = kNotLaunched;
    }
  }
  Py_XDECREF(launcher);
  Py_XDECREF(plan);
  Py_XDECREF(record);
  Py_XDECREF(prototype);
  Py_XDECREF(stream_of);
  Py_XDECREF(stream);
  if (PyErr_Occurred()) PyErr_Clear();  // the Python path meets the same condition and raises it
  return status;
}

bool channels_last(const at::Tensor& t) {  // tiledispatch.torch._is_channels_last
  if (t.dim() == 4) return t.is_contiguous(at::MemoryFormat::ChannelsLast);
  if (t.dim() == 5) return t.is_contiguous(at::MemoryFormat::ChannelsLast3d);
  return t.dim() == 3 ? t.transpose(1, -1).is_contiguous() : t.movedim(1, -1).is_contiguous();
}

// -- record: a C++ autograd node around Python forward and backward functions --------------------------------
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// Holds a Python reference; drops it with the GIL (a node may die on an autograd worker thread).
struct PyRef {
  PyObject* object;
  explicit PyRef(PyObject* o) : object(Py_NewRef(o)) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (!Py_IsInitialized()) return;  // the interpreter is gone: nothing to release into
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(object);
    PyGILState_Release(gil);
  }
};

struct PythonBackward : Node {
  PyRef backward, backward_once, spec, link;
  std::string label;
  std::vector<SavedVariable> saved;  // a default-constructed one (a None saved) unpacks to an undefined tensor

  PythonBackward(PyObject* b, PyObject* once, PyObject* s, PyObject* l, std::string name)
      : backward(b), backward_once(once), spec(s), link(l), label(std::move(name)) {}

  std::string name() const override { return label; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : saved) s.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t outputs = num_outputs();
    variable_list result(outputs);
    if (grads.empty() || !grads[0].defined()) return result;  // a zero gradient in: zero (undefined) ones out
    std::vector<at::Tensor> unpacked;
    unpacked.reserve(saved.size());
    for (const auto& s : saved) unpacked.push_back(s.unpack());  // raises where one changed in place since
    PyGILState_STATE gil = PyGILState_Ensure();
    if (!torch::autograd::GradMode::is_enabled() && planned(unpacked, grads[0], result)) {
      PyGILState_Release(gil);
      return result;
    }
    PyObject* answer = call(unpacked, grads[0]);
    const bool ok = answer != nullptr && take(answer, result);
    Py_XDECREF(answer);
    if (!ok) {
      python_error error;
      error.persist();  // fetches the Python exception; the caller's backward() raises it again
      PyGILState_Release(gil);
      throw std::move(error);
    }
    PyGILState_Release(gil);
    return result;
  }

 private:
  PyObject* wrap(const at::Tensor& t) { return t.defined() ? THPVariable_Wrap(t) : Py_NewRef(Py_None); }

  // The backward plan that the link carries (a conv's: saved x, w, None, None; inputs x, w, bias), run where
  // this call is the one it was made for; false (result untouched) where the Python backward function runs
  // instead. With the GIL.
  bool planned(const std::vector<at::Tensor>& unpacked, const at::Tensor& grad, variable_list& result) {
    if (link.object == Py_None || num_outputs() != 3 || unpacked.size() != 4) return false;
    PyObject* capsule = PyObject_GetAttr(link.object, kNativeBackwardAttr);
    bool done = false;
    if (capsule && PyCapsule_IsValid(capsule, kBackwardPlan)) {
      variable_list made(3);
      try {
        done = run(*static_cast<const BackwardPlan*>(PyCapsule_GetPointer(capsule, kBackwardPlan)), unpacked, grad,
                   made);
      } catch (...) {  // torch refused something (e.g. the copy): the Python path meets it and says what
        done = false;
      }
      if (done) result = std::move(made);
    }
    Py_XDECREF(capsule);
    if (PyErr_Occurred()) PyErr_Clear();
    return done;
  }

  bool run(const BackwardPlan& plan, const std::vector<at::Tensor>& unpacked, const at::Tensor& grad,
           variable_list& made) {
    if (PyThread_get_thread_ident() != plan.thread) return false;
    for (size_t i = 0; i < 3; ++i)
      if (should_compute_output(i) != plan.needs[i]) return false;
    const at::Tensor& x = unpacked[0];
    const at::Tensor& w = unpacked[1];
    if (!x.defined() || !w.defined() || unpacked[3].defined() || !plain_eager(grad)) return false;
    const at::Tensor gy = channels_last(grad) ? grad : grad.movedim(1, -1).contiguous().movedim(-1, 1);
    if ((plan.needs[0] && !printed_as(gy, w, plan.data.print)) ||
        (plan.needs[1] && !printed_as(x, gy, plan.weight.print)))
      return false;
    const auto pointer = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); };
    if (plan.needs[0] && launch_planned(plan.data, gy, pointer(gy), pointer(w), made[0]) != TD_OK) return false;
    if (plan.needs[1] && launch_planned(plan.weight, x, pointer(x), pointer(gy), made[1]) != TD_OK) return false;
    if (plan.needs[2]) {  // the bias gradient: dY summed over N and the spatial dims
      std::vector<int64_t> dims{0};
      for (int64_t d = 2; d < gy.dim(); ++d) dims.push_back(d);
      made[2] = gy.sum(dims);
    }
    return true;
  }

  // backward((saved, spec, needs, link), grad), with the GIL
  PyObject* call(const std::vector<at::Tensor>& unpacked, const at::Tensor& grad) {
    PyObject* saved_tuple = PyTuple_New(unpacked.size());
    PyObject* needs = PyTuple_New(num_outputs());
    PyObject* g = wrap(grad);
    PyObject* state = nullptr;
    PyObject* answer = nullptr;
    if (saved_tuple && needs && g) {
      bool filled = true;
      for (size_t i = 0; i < unpacked.size() && filled; ++i) {
        PyObject* item = wrap(unpacked[i]);
        filled = item != nullptr;
        if (filled) PyTuple_SET_ITEM(saved_tuple, i, item);
      }
      for (size_t i = 0; i < num_outputs(); ++i)
        PyTuple_SET_ITEM(needs, i, Py_NewRef(should_compute_output(i) ? Py_True : Py_False));
      if (filled) state = PyTuple_Pack(4, saved_tuple, spec.object, needs, link.object);
      if (state) {
        PyObject* fn = torch::autograd::GradMode::is_enabled() ? backward_once.object : backward.object;
        answer = PyObject_CallFunctionObjArgs(fn, state, g, nullptr);
      }
    }
    Py_XDECREF(saved_tuple);
    Py_XDECREF(needs);
    Py_XDECREF(g);
    Py_XDECREF(state);
    return answer;
  }

  // answer: one gradient or None per input, into result; false with a Python exception set
  bool take(PyObject* answer, variable_list& result) {
    if (!PyTuple_Check(answer) || PyTuple_GET_SIZE(answer) != static_cast<Py_ssize_t>(result.size())) {
      PyErr_Format(PyExc_RuntimeError, "%s: the backward function returned %R, expected a tuple of %zd gradients",
                   label.c_str(), answer, static_cast<Py_ssize_t>(result.size()));
      return false;
    }
    for (size_t i = 0; i < result.size(); ++i) {
      PyObject* item = PyTuple_GET_ITEM(answer, i);
      if (item == Py_None) continue;
      if (!THPVariable_Check(item)) {
        PyErr_Format(PyExc_TypeError, "%s: gradient %zd is %R, not a tensor", label.c_str(),
                     static_cast<Py_ssize_t>(i), item);
        return false;
      }
      result[i] = THPVariable_Unpack(item);
    }
    return true;
  }
};

// The pointer type the autograd graph holds nodes by: std::shared_ptr in older torch, c10::intrusive_ptr in newer.
using NodePtr = std::decay_t<decltype(std::declval<torch::autograd::Edge&>().function)>;

template <typename Ptr>
struct MakeNode;
template <typename T>
struct MakeNode<std::shared_ptr<T>> {
  template <typename N, typename... A>
  static std::shared_ptr<N> make(A&&... args) { return std::make_shared<N>(std::forward<A>(args)...); }
};
template <typename T>
struct MakeNode<c10::intrusive_ptr<T>> {
  template <typename N, typename... A>
  static c10::intrusive_ptr<N> make(A&&... args) { return c10::make_intrusive<N>(std::forward<A>(args)...); }
};

PyObject* record(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr Py_ssize_t kFixed = 5;
  if (nargs < kFixed || !PyUnicode_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "record(forward, backward, backward_once, spec, name: str, *inputs)");
    return nullptr;
  }
  std::vector<at::Tensor> inputs;
  for (Py_ssize_t i = kFixed; i < nargs; ++i) {
    if (args[i] != Py_None && !THPVariable_Check(args[i])) {
      PyErr_Format(PyExc_TypeError, "record: input %zd is %R, not a tensor or None", i - kFixed, args[i]);
      return nullptr;
    }
    inputs.push_back(args[i] == Py_None ? at::Tensor() : THPVariable_Unpack(args[i]));
  }
  PyObject* made;
  {
    torch::autograd::AutoGradMode no_grad(false);
    // The caller cast the inputs where autocast is on; the forward runs with it off on their device, as
    // torch.amp.custom_fwd(cast_inputs=...) runs one, so that its launch may be a remembered call.
    const at::Tensor* first = nullptr;
    for (const auto& t : inputs) first = first ? first : (t.defined() ? &t : nullptr);
    const at::DeviceType device = first ? first->device().type() : at::kCPU;
    const bool autocast = at::autocast::is_autocast_enabled(device);
    if (autocast) at::autocast::set_autocast_enabled(device, false);
    std::vector<PyObject*> call_args(args + 3, args + 4);  // spec, then the inputs
    call_args.insert(call_args.end(), args + kFixed, args + nargs);
    made = PyObject_Vectorcall(args[0], call_args.data(), call_args.size(), nullptr);
    if (autocast) at::autocast::set_autocast_enabled(device, true);
  }
  if (made == nullptr) return nullptr;
  PyObject* output = nullptr;
  PyObject* to_save = nullptr;
  const Py_ssize_t returned = PyTuple_Check(made) ? PyTuple_GET_SIZE(made) : 0;
  if ((returned != 2 && returned != 3) || !THPVariable_Check(PyTuple_GET_ITEM(made, 0)) ||
      !PyTuple_Check(PyTuple_GET_ITEM(made, 1))) {
    PyErr_Format(PyExc_TypeError, "record: forward returned %R, expected (output tensor, saved tuple[, link])", made);
    Py_DECREF(made);
    return nullptr;
  }
  output = PyTuple_GET_ITEM(made, 0);
  to_save = PyTuple_GET_ITEM(made, 1);
  bool wanted = false;
  for (const auto& t : inputs) wanted = wanted || (t.defined() && t.requires_grad());
  if (!torch::autograd::GradMode::is_enabled() || !wanted) {
    PyObject* result = Py_NewRef(output);
    Py_DECREF(made);
    return result;
  }
  try {
    at::Tensor y = THPVariable_Unpack(output);
    if (y.is_view()) y = y.detach();  // a view made without grad would refuse in-place changes once recorded
    std::string name(PyUnicode_AsUTF8(args[4]));
    PyObject* link = returned == 3 ? PyTuple_GET_ITEM(made, 2) : Py_None;
    auto node = MakeNode<NodePtr>::make<PythonBackward>(args[1], args[2], args[3], link, std::move(name));
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    torch::autograd::set_history(y, node);
    const Py_ssize_t count = PyTuple_GET_SIZE(to_save);
    node->saved.reserve(count);
    for (Py_ssize_t i = 0; i < count; ++i) {
      PyObject* item = PyTuple_GET_ITEM(to_save, i);
      if (item == Py_None) {
        node->saved.emplace_back();
      } else if (!THPVariable_Check(item)) {
        PyErr_Format(PyExc_TypeError, "record: saved item %zd is %R, not a tensor or None", i, item);
        Py_DECREF(made);
        return nullptr;
      } else if (item == output) {  // the output, detached: saved with its history it would keep the node alive
        node->saved.emplace_back(y.detach(), false);
      } else {
        node->saved.emplace_back(THPVariable_Unpack(item), false);
      }
    }
    Py_DECREF(made);
    return THPVariable_Wrap(std::move(y));
  } catch (...) {
    Py_DECREF(made);
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"prints", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(prints)), METH_FASTCALL,
     "prints(*tensors) -> (pointers, fingerprint bytes), or None for an argument this reader does not take"},
    {"eager_prints", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(eager_prints)), METH_FASTCALL,
     "eager_prints(*tensors) -> prints(*tensors), or None also when a mode, the tracer, the profiler or autocast may "
     "intercept"},
    {"launcher", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(launcher)), METH_FASTCALL,
     "launcher(run, args, reason, reason_bytes, sources, written, written_span, reads, exact, align) -> record"},
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(launch)), METH_FASTCALL,
     "launch(record, prototype, like, pointers, stream) -> output, None (not launched) or a status int"},
    {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record)), METH_FASTCALL,
     "record(forward, backward, backward_once, spec, name, *inputs) -> output, recorded for autograd"},
    {"backward_plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(backward_plan)), METH_FASTCALL,
     "backward_plan(thread, data_call, data_print, weight_call, weight_print, needs_x, needs_w, needs_bias) -> plan"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_td_torch_fastpath", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__td_torch_fastpath() {
  const std::pair<PyObject**, const char*> names[] = {
      {&kLauncherAttr, "launcher"}, {&kPlanAttr, "plan"},         {&kArgsAttr, "args"},
      {&kPlanArgsAttr, "_args"},    {&kAlphaAttr, "alpha"},       {&kBetaAttr, "beta"},
      {&kRecordAttr, "record"},     {&kPrototypeAttr, "prototype"}, {&kStreamOfAttr, "_stream_of"},
      {&kPtrsAttr, "_ptrs"},        {&kNativeBackwardAttr, "native_backward"}};
  for (const auto& [slot, text] : names) {
    *slot = PyUnicode_InternFromString(text);
    if (*slot == nullptr) return nullptr;
  }
  return PyModule_Create(&module);
}

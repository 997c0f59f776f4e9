// gradstore's node hooks in C++: a prehook and a hook on every autograd Node of a pass, recording each call
// (order, start, duration) and each gradient (dtype, shape, and at 'health'/'full' the fused kernel's
// statistics) without entering Python. Built and loaded by gradstore/recording/native.py, which documents the contract;
// gradstore/recording/passes.py drives it. What the hooks here cannot measure themselves (a tensor subclass, a device
// tensor, float16, a non-dense layout, finite float64 values whose squares overflow, a tensor large enough to split
// across threads) they hand to the Python measurement (`fallback`, with the GIL), so every row equals what the Python
// hooks would record. NaN and Inf are counted here, by the kernel's gs_stats (the function Python measures with).
//
// The hooks return their gradients unchanged (the same tensors): recording never changes a gradient.
// PyTorch API used (torch/csrc/autograd): Node::add_pre_hook / pre_hooks() / add_post_hook / del_post_hook,
// Node::next_edges / sequence_nr / name, AccumulateGrad::variable, functionToPyObject (the graph walk),
// FunctionPreHook / FunctionPostHook, get_current_graph_task_id(), THPCppFunction / THPFunction (the Python
// grad_fn objects' Node), THPVariable_Wrap; c10: TensorImpl::pyobj_slot(), version_counter(); ATen: addGlobalCallback /
// removeCallback, RecordFunction::name / scope, isRecordFunctionEnabled (the operator watch, `ops_watch`).
#include <Python.h>

#include <cmath>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <typeindex>
#include <unordered_map>
#include <vector>

namespace torch::dynamo::autograd {
class CompiledNodeArgs;  // declared by function_hook.h where compiled autograd exists; here for the others
}  // namespace torch::dynamo::autograd

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

constexpr int ABI = 20;
enum Level { SHAPE = 0, HEALTH = 1, FULL = 2 };
enum Kind : int8_t { K_NONE = 0, K_SHAPE = 1, K_STATS = 2, K_PY = 3 };
enum Role : int8_t { R_OUT = 0, R_IN = 1 };

// kernels/reduce.c gs_stats: the statistics vector of n values (kind 0 float32, 1 float64; level 1 health, 2 full)
typedef int (*stats_fn)(const void*, int64_t, int, int, double*);

struct Globals {
  stats_fn stats = nullptr;  // nullptr: no kernel (every statistic is measured by Python)
  int16_t dtype_code[256];  // ScalarType -> schema dtype code of a plain real dtype; -1: ask Python
  PyObject* fallback = nullptr;  // fallback(tensor, level) -> the Python measurement (never raises)
  PyObject* reuse = nullptr;  // reuse(measurement, tensor) -> the measurement with the tensor's shape, or None
  PyObject* plain[2] = {nullptr, nullptr};  // torch.Tensor, torch.nn.Parameter
  int64_t split = 1 << 19;
  // row codes: STATUS ok / none, ROLE grad_output / grad_input
  long status_ok = 0, status_none = 0, role_code[2] = {0, 0};
  long columns = 19;  // len(ROW_COLUMNS) + 1 (gradstore.recording.stats): the row's items after the first 4
  bool ready = false;
} G;

struct Result {
  Kind kind = K_NONE;
  int16_t dtype = 0;
  int64_t numel = 0;
  c10::SmallVector<int64_t, 5> sizes;
  double vec[10] = {};  // zeros where nothing is measured: packed bytes hold no indeterminate memory
  PyObject* py = nullptr;  // K_PY: owned reference
  Result() = default;
  Result(const Result& o) : kind(o.kind), dtype(o.dtype), numel(o.numel), sizes(o.sizes), py(o.py) {
    std::copy(o.vec, o.vec + 10, vec);
    if (py) {
      PyGILState_STATE g = PyGILState_Ensure();
      Py_INCREF(py);
      PyGILState_Release(g);
    }
  }
  Result(Result&& o) noexcept : kind(o.kind), dtype(o.dtype), numel(o.numel), sizes(std::move(o.sizes)), py(o.py) {
    std::copy(o.vec, o.vec + 10, vec);
    o.py = nullptr;
  }
  Result& operator=(const Result&) = delete;
  ~Result() {
    if (py) {
      PyGILState_STATE g = PyGILState_Ensure();
      Py_DECREF(py);
      PyGILState_Release(g);
    }
  }
};

struct Entry {
  int32_t call;
  Role role;
  int32_t slot;
  Result r;
};

struct Call {
  int32_t node;
  int64_t seq;
  double start = 0, dur = 0;
  bool ended = false;
  std::vector<int32_t> outs;  // entry index of each grad_output
  std::vector<int64_t> versions;  // each grad_output's version counter when measured, -1: none
};

struct Memo {
  c10::weak_intrusive_ptr<c10::TensorImpl> ref;
  uint32_t version;
  int32_t entry;
};

struct Pass;
struct Dispatch;

struct Step {
  std::mutex mu;
  std::atomic<int64_t> seq{0};
  std::vector<Pass*> active;
};

struct Open {
  Step* step;
  int pass;
  int64_t seq;
};
thread_local std::vector<Open> t_open;  // this thread's open calls (innermost last), across steps

struct Pass {
  std::shared_ptr<Step> step;
  int number = 0;
  Level level = FULL;
  std::mutex mu;
  std::atomic<bool> active{true};
  std::atomic<bool> claimed{false};
  int64_t task = -1;
  std::chrono::steady_clock::time_point t0;
  std::vector<char> trusted;
  std::vector<char> claimable;  // the pass's roots: where its graph task is first seen
  std::vector<int32_t> open;  // node index -> open call index, -1 none
  std::vector<Call> calls;
  std::vector<Entry> entries;
  std::unordered_map<c10::TensorImpl*, Memo> seen;
  int64_t measured = 0, reused = 0;
  std::vector<std::string> faults;
  std::vector<std::pair<c10::intrusive_ptr<Node>, std::shared_ptr<Dispatch>>> hooked;

  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

// ---- measuring one tensor ------------------------------------------------------------------------------------
bool plain_type(c10::TensorImpl* impl) {
  if (impl->is_python_dispatch()) return false;
  PyObject* obj = impl->pyobj_slot()->load_pyobj();
  if (obj == nullptr) return true;  // no Python object yet: it would be a torch.Tensor
  PyObject* type = (PyObject*)Py_TYPE(obj);
  return type == G.plain[0] || type == G.plain[1];
}

bool dense(const at::Tensor& t) {  // the elements fill one gap-free block, in some dimension order
  if (t.is_contiguous()) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;
  auto sizes = t.sizes();
  auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] != 1) dims.emplace_back(strides[d], sizes[d]);
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

void set_shape(Result& r, const at::Tensor& t, int16_t code) {
  r.dtype = code;
  auto s = t.sizes();
  r.sizes.assign(s.begin(), s.end());
  r.numel = t.numel();
}

Result python_measure(const at::Tensor& t, Level level) {
  Result r;
  r.kind = K_PY;
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject* obj = THPVariable_Wrap(t);
  if (obj != nullptr) {
    r.py = PyObject_CallFunction(G.fallback, "Oi", obj, (int)level);
    Py_DECREF(obj);
  }
  if (r.py == nullptr) {  // a fault in the fallback itself: ask it for a skipped row saying so
    PyErr_Clear();
    r.py = PyObject_CallFunction(G.fallback, "si", "gradstore: the tensor could not be handed to Python", (int)level);
    if (r.py == nullptr) {
      PyErr_Clear();
      r.py = Py_None;
      Py_INCREF(r.py);
    }
  }
  PyGILState_Release(g);
  return r;
}

// a grad_input that is the same memory as a grad_output Python measured (r, a copy of that result): r becomes
// that measurement with g's shape (gradstore.recording.stats.Measurer.grad_inputs); false where it holds no statistics
bool python_reuse(Result& r, const at::Tensor& g) {
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* obj = THPVariable_Wrap(g);
  PyObject* out = obj ? PyObject_CallFunction(G.reuse, "OO", r.py, obj) : nullptr;
  Py_XDECREF(obj);
  bool ok = out != nullptr && out != Py_None;
  if (out == nullptr) PyErr_Clear();
  if (ok) {
    Py_DECREF(r.py);
    r.py = out;
  } else {
    Py_XDECREF(out);
  }
  PyGILState_Release(gil);
  return ok;
}

// the kernel's statistics of a dense float32/float64 CPU tensor with numel > 0, NaN and Inf counted exactly (gs_stats:
// the same function, so the same values, as gradstore.recording.stats measures with); false: finite float64 values
// whose squares or sums overflow, which the Python measurement scales
bool kernel_stats(const at::Tensor& t, Level level, Result& r) {
  int k = t.scalar_type() == at::kFloat ? 0 : 1;
  return G.stats(t.const_data_ptr(), r.numel, k, level, r.vec) == 0;
}

// a tensor whose memory the C++ side may read: not nested (a NestedTensorImpl has no sizes), with storage (a
// torch.func wrapper -- grad, vmap, jacrev -- has none), of a plain type, dense layout, not meta
bool readable(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return !t.is_nested() && impl->has_storage() && plain_type(impl) && t.layout() == at::kStrided && !t.is_meta();
}

// the C++ side's own measurement of t into r; false: hand t to Python
bool measure_here(const at::Tensor& t, Level level, Result& r) {
  if (!readable(t)) return false;
  auto st = t.scalar_type();
  int16_t code = G.dtype_code[(int)st & 0xff];
  if (code < 0) return false;
  if (level == SHAPE) {
    r.kind = K_SHAPE;
    set_shape(r, t, code);
    return true;
  }
  if (!((st == at::kFloat || st == at::kDouble) && t.device().is_cpu() && !t.is_neg() && !t.is_conj() && dense(t)))
    return false;
  set_shape(r, t, code);
  if (r.numel == 0) {
    r.kind = K_SHAPE;  // 'ok', empty: norm 0, zero counts
    return true;
  }
  if (G.stats != nullptr && (r.numel < 2 * G.split || at::get_num_threads() <= 1) && kernel_stats(t, level, r)) {
    r.kind = K_STATS;
    return true;
  }
  return false;
}

// what gradstore.recording.stats.measure (level health/full) or shape_only (level shape) records for t; anything
// the C++ side cannot read (or that throws while it reads it) is measured by Python, as the Python hooks would
Result measure(const at::Tensor& t, Level level) {
  if (!t.defined()) return Result();  // K_NONE: the slot held None
  try {
    Result r;
    if (measure_here(t, level, r)) return r;
  } catch (const std::exception&) {
  }
  return python_measure(t, level);
}

int64_t version_of(const at::Tensor& t) {  // -1: none (as Python's `_version` raising, for the reuse rules)
  if (!t.defined()) return -1;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->is_inference()) return -1;
  try {
    return impl->version_counter().current_version();
  } catch (const std::exception&) {
    return -1;
  }
}

// the pass's one result per distinct gradient: an object seen before at the same version reuses its entry
Result measure_once(const at::Tensor& t, Pass& p, bool fresh) {
  if (!t.defined()) return Result();
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  int64_t version = version_of(t);
  if (!fresh && version >= 0) {
    std::unique_lock<std::mutex> lock(p.mu);
    auto it = p.seen.find(impl);
    if (it != p.seen.end() && !it->second.ref.expired() && it->second.version == (uint32_t)version) {
      p.reused++;
      Result copy(p.entries[it->second.entry].r);
      return copy;
    }
  }
  Result r = measure(t, p.level);
  std::unique_lock<std::mutex> lock(p.mu);
  p.measured++;
  return r;
}

void remember(Pass& p, const at::Tensor& t, int32_t entry) {  // caller holds p.mu
  if (!t.defined()) return;
  int64_t version = version_of(t);
  if (version < 0) return;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  p.seen.insert_or_assign(impl, Memo{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()),
                                     (uint32_t)version, entry});
}

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return false;
  if (!readable(a) || !readable(b)) return false;
  try {
    if (a.const_data_ptr() != b.const_data_ptr()) return false;
    return a.scalar_type() == b.scalar_type() && a.device() == b.device() && a.numel() == b.numel() &&
           a.numel() > 0 && dense(a) && dense(b);
  } catch (const std::exception&) {
    return false;
  }
}

// ---- the graph task a hook fires for --------------------------------------------------------------------------
// a pass takes the graph task of the first hook that fires on one of its roots (`claimable`): a hook that fires
// for a shared Node (a parameter's AccumulateGrad) in another thread's backward never makes it that pass's
bool accept(Pass& p, int32_t node) {
  int64_t tid = torch::autograd::get_current_graph_task_id();
  if (p.claimed.load(std::memory_order_acquire)) return p.task == tid;
  if (!p.claimable[node]) return false;
  std::lock_guard<std::mutex> g(p.step->mu);
  if (p.claimed.load(std::memory_order_relaxed)) return p.task == tid;
  for (Pass* o : p.step->active)
    if (o != &p && o->claimed.load(std::memory_order_relaxed) && o->task == tid) return false;
  p.task = tid;
  p.claimed.store(true, std::memory_order_release);
  return true;
}

std::string what_of(const std::exception& e) {
  std::string s = e.what();
  auto cut = s.find('\n');
  return s.substr(0, std::min(cut, (size_t)400));
}

// node `node` of pass p is about to run: a call starts; its grad_outputs are measured
void pre_call(Pass& p, int32_t node, const variable_list& grads) {
    if (!p.active.load(std::memory_order_relaxed)) return;
    try {
      if (!accept(p, node)) return;
      std::vector<Result> rs;
      rs.reserve(grads.size());
      for (const auto& g : grads) rs.push_back(p.level == SHAPE ? measure(g, SHAPE) : measure_once(g, p, false));
      std::lock_guard<std::mutex> lock(p.mu);
      Call c;
      c.node = node;
      c.seq = p.step->seq.fetch_add(1);
      int32_t ci = (int32_t)p.calls.size();
      for (size_t s = 0; s < grads.size(); ++s) {
        int32_t e = (int32_t)p.entries.size();
        p.entries.push_back(Entry{ci, R_OUT, (int32_t)s, std::move(rs[s])});
        c.outs.push_back(e);
        c.versions.push_back(p.level == SHAPE ? -1 : version_of(grads[s]));
        if (p.level != SHAPE && !(p.entries[e].r.kind == K_NONE)) remember(p, grads[s], e);
      }
      p.open[node] = ci;
      t_open.push_back(Open{p.step.get(), p.number, c.seq});
      c.start = p.now();
      p.calls.push_back(std::move(c));
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(p.mu);
      p.faults.push_back("prehook: " + what_of(e));
    }
}

// node `node` of pass p has run: the call ends; its grad_inputs are measured
void post_call(Pass& p, int32_t node, const variable_list& grad_inputs, const variable_list& grad_outputs) {
    if (!p.active.load(std::memory_order_relaxed)) return;
    try {
      double t = p.now();
      if (!accept(p, node)) return;
      int32_t ci;
      std::vector<int32_t> outs;
      std::vector<int64_t> versions;
      {
        std::lock_guard<std::mutex> lock(p.mu);
        ci = p.open[node];
        if (ci < 0) return;
        p.open[node] = -1;
        Call& c = p.calls[ci];
        c.dur = t - c.start;
        c.ended = true;
        if (!t_open.empty() && t_open.back().seq == c.seq && t_open.back().pass == p.number &&
            t_open.back().step == p.step.get())
          t_open.pop_back();
        outs = c.outs;
        versions = c.versions;
      }
      bool trusted = p.trusted[node];
      std::vector<Result> rs;
      rs.reserve(grad_inputs.size());
      for (const auto& g : grad_inputs) {
        if (p.level == SHAPE || !trusted || !g.defined()) {
          rs.push_back(p.level == SHAPE || !g.defined() ? measure(g, p.level) : measure_once(g, p, true));
          continue;
        }
        bool done = false;
        // a grad_input that is the same memory as an unmodified grad_output: that output's statistics
        for (size_t s = 0; s < grad_outputs.size() && s < outs.size(); ++s) {
          const at::Tensor& go = grad_outputs[s];
          if (!go.defined() || versions[s] < 0 || version_of(go) != versions[s] || !same_memory(g, go)) continue;
          std::unique_lock<std::mutex> lock(p.mu);
          const Result& mo = p.entries[outs[s]].r;
          if (mo.kind != K_STATS && mo.kind != K_PY) continue;
          Result r(mo);
          lock.unlock();
          if (r.kind == K_PY && !python_reuse(r, g)) continue;  // the Python result holds no statistics
          auto sz = g.sizes();
          r.sizes.assign(sz.begin(), sz.end());
          lock.lock();
          p.reused++;
          rs.push_back(std::move(r));
          done = true;
          break;
        }
        if (!done) rs.push_back(measure_once(g, p, false));
      }
      std::lock_guard<std::mutex> lock(p.mu);
      for (size_t s = 0; s < rs.size(); ++s) {
        int32_t e = (int32_t)p.entries.size();
        bool was_none = rs[s].kind == K_NONE;
        p.entries.push_back(Entry{ci, R_IN, (int32_t)s, std::move(rs[s])});
        if (p.level != SHAPE && !was_none) remember(p, grad_inputs[s], e);
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(p.mu);
      p.faults.push_back("hook: " + what_of(e));
    }
}

// ---- the hooks on a Node ---------------------------------------------------------------------------------------
// A Node gets one gradstore prehook and one hook for its lifetime, added the first time a pass hooks it; passes
// register with them and unregister when they finish. A Node's hook lists are read by the engine without a lock
// (another thread may be running a backward pass through a shared AccumulateGrad node), so they are appended
// to once per Node, like torch's own Python hooks, and never shrunk; what changes per pass is this list,
// under its own mutex.
struct Dispatch {
  std::mutex mu;
  std::vector<std::pair<std::shared_ptr<Pass>, int32_t>> passes;  // (pass, the node's index in its walk)
  // a copy to call without the lock (a pass may finish meanwhile); usually one pass: no allocation
  c10::SmallVector<std::pair<std::shared_ptr<Pass>, int32_t>, 2> snapshot() {
    std::lock_guard<std::mutex> g(mu);
    return c10::SmallVector<std::pair<std::shared_ptr<Pass>, int32_t>, 2>(passes.begin(), passes.end());
  }
};

// Compiled autograd (torch._dynamo.compiled_autograd) asks each hook of a Node to register itself for tracing
// (compiled_args); the base class raises "compiled_args nyi". gradstore's hooks register nothing: a compiled pass
// never runs them, exactly as if they were not there. gradstore records a compiled-autograd pass with Python
// hooks (gradstore.recording.passes), and a Node that outlives a recording (a parameter's AccumulateGrad held by
// DDP's reducer or an optimizer in backward) keeps these hooks with an empty pass list: invisible.
struct DispatchPre : torch::autograd::FunctionPreHook {
  std::shared_ptr<Dispatch> d;
  explicit DispatchPre(std::shared_ptr<Dispatch> d) : d(std::move(d)) {}
  variable_list operator()(const variable_list& grads) override {
    for (auto& [pass, i] : d->snapshot()) pre_call(*pass, i, grads);
    return grads;  // the same tensors: never a changed gradient
  }
  // both spellings: older torch declares compiled_args non-const, newer const; the one the base has is overridden
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const {}
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) {}
};

struct DispatchPost : torch::autograd::FunctionPostHook {
  std::shared_ptr<Dispatch> d;
  explicit DispatchPost(std::shared_ptr<Dispatch> d) : d(std::move(d)) {}
  variable_list operator()(const variable_list& grad_inputs, const variable_list& grad_outputs) override {
    for (auto& [pass, i] : d->snapshot()) post_call(*pass, i, grad_inputs, grad_outputs);
    return grad_inputs;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const {}
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) {}
};

std::mutex g_install;  // serialises the first hooking of Nodes (two passes may hook one Node at once)

std::shared_ptr<Dispatch> dispatch_of(Node* node) {  // caller holds g_install
  for (const auto& h : node->pre_hooks())
    if (auto* dp = dynamic_cast<DispatchPre*>(h.get())) return dp->d;
  auto d = std::make_shared<Dispatch>();
  node->add_pre_hook(std::make_unique<DispatchPre>(d));
  node->add_post_hook(std::make_unique<DispatchPost>(d));
  return d;
}

void unregister(Pass& p) {  // the pass leaves every Node's dispatch list (its hooks stay, empty for it)
  std::vector<std::pair<c10::intrusive_ptr<Node>, std::shared_ptr<Dispatch>>> hooked;
  hooked.swap(p.hooked);
  for (auto& [node, d] : hooked) {
    std::lock_guard<std::mutex> g(d->mu);
    auto& v = d->passes;
    v.erase(std::remove_if(v.begin(), v.end(), [&](const auto& x) { return x.first.get() == &p; }), v.end());
  }
}

// ---- the graph walk ----------------------------------------------------------------------------------------------
// walk(roots, base) -> (nodes, edges, seqs, signature, leaves, index): gradstore.recording.graph.walk in one call, with
// what gradstore.recording.graph's signature reads of each node, read in the same loop (see graph.py).
// nodes: the Node objects in walk order (depth-first from the roots, in next_functions order: the order of
// graph.walk), or with lazy=1 a capsule holding the Nodes in that order (WalkNodes, below); edges: bytes, four
// native int32 per edge (src index, src slot, dst index, dst slot); seqs: each node's sequence_nr; signature:
// bytes, per node its name's number (the same name, the same number, in this process), whether it is a Python
// Node (custom Function) and, except for a node whose name ends in AccumulateGrad, its sequence_nr minus base;
// leaves: per such AccumulateGrad node, in walk order, id() of its variable's Python object (0: none); index:
// {id(node object) (lazy: the C++ Node's address): its position} (graph.Walk.index).
struct NameOf {
  int32_t id;
  bool accumulate;
};
std::mutex g_names;
std::unordered_map<std::string, int32_t> g_name_ids;
std::unordered_map<std::type_index, NameOf> g_type_names;  // a C++ Node class's name is its class's

NameOf name_number(const std::string& name) {  // caller holds g_names
  auto it = g_name_ids.find(name);
  int32_t id;
  if (it == g_name_ids.end()) {
    id = (int32_t)g_name_ids.size();
    g_name_ids.emplace(name, id);
  } else {
    id = it->second;
  }
  const std::string tail = "AccumulateGrad";
  bool acc = name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  return NameOf{id, acc};
}

NameOf name_of(Node* node, bool python) {
  if (python) {  // a custom Function's Node: named by its Python class, which the type does not tell
    std::string name = node->name();
    std::lock_guard<std::mutex> g(g_names);
    return name_number(name);
  }
  std::type_index type(typeid(*node));
  {
    std::lock_guard<std::mutex> g(g_names);
    auto it = g_type_names.find(type);
    if (it != g_type_names.end()) return it->second;
  }
  std::string name = node->name();
  std::lock_guard<std::mutex> g(g_names);
  NameOf n = name_number(name);
  g_type_names.emplace(type, n);
  return n;
}

Node* node_of(PyObject* o);

// walk(..., lazy=1): the walked Nodes held here, in walk order, in place of a list of their Python objects; a Node's
// object is made only where one is asked for (walk_node). Making 633 of them a pass (benchmarks/steady.py's MLP)
// took longer than the rest of the walk, and the garbage collector tracks each: they started a collection in
// most passes, and, promoted with the step, full ones now and then.
const char* WALK = "gradstore.walk_nodes";
struct WalkNodes {
  std::vector<c10::intrusive_ptr<Node>> nodes;
};
void walk_nodes_free(PyObject* cap) { delete (WalkNodes*)PyCapsule_GetPointer(cap, WALK); }

// whether a Node is a custom Function's (PyNode), by its C++ class: the first Node of a class is asked through its
// Python object (libtorch_python does not export PyNode's type information for a dynamic_cast here)
std::unordered_map<std::type_index, bool> g_python_types;

bool is_python_node(Node* node) {
  std::type_index type(typeid(*node));
  {
    std::lock_guard<std::mutex> g(g_names);
    auto it = g_python_types.find(type);
    if (it != g_python_types.end()) return it->second;
  }
  PyObject* py = torch::autograd::functionToPyObject(c10::intrusive_ptr<Node>::reclaim_copy(node));
  if (py == nullptr) throw std::runtime_error("walk(): a Node could not be wrapped");
  bool python = THPFunction_Check(py);
  Py_DECREF(py);
  std::lock_guard<std::mutex> g(g_names);
  g_python_types.emplace(type, python);
  return python;
}

PyObject* py_walk(PyObject*, PyObject* args) {
  PyObject* roots;
  long long base;
  int lazy = 0;
  if (!PyArg_ParseTuple(args, "O!L|p", &PyList_Type, &roots, &base, &lazy)) return nullptr;
  Py_ssize_t nroots = PyList_GET_SIZE(roots);
  std::vector<std::pair<Node*, PyObject*>> stack;  // (node, its Python object if known: a root's, borrowed)
  for (Py_ssize_t i = nroots - 1; i >= 0; --i) {
    PyObject* o = PyList_GET_ITEM(roots, i);
    Node* n = node_of(o);
    if (n == nullptr) {
      PyErr_Format(PyExc_TypeError, "root %zd is not an autograd Node (%s)", i, Py_TYPE(o)->tp_name);
      return nullptr;
    }
    stack.emplace_back(n, o);
  }
  std::unordered_map<Node*, int32_t> index;
  std::vector<Node*> order;
  auto held = lazy ? std::make_unique<WalkNodes>() : nullptr;
  PyObject* nodes = lazy ? nullptr : PyList_New(0);
  PyObject* seqs = PyList_New(0);
  PyObject* leaves = PyList_New(0);
  PyObject* ids = PyDict_New();
  std::string sig;
  bool failed = (nodes == nullptr && !lazy) || seqs == nullptr || leaves == nullptr || ids == nullptr;
  try {
    while (!stack.empty() && !failed) {
      auto [node, obj] = stack.back();
      stack.pop_back();
      if (index.count(node)) continue;
      bool python;  // a custom Function's Node (PyNode)
      if (lazy) {  // keyed by the Node's address; its Python object is not made
        held->nodes.push_back(c10::intrusive_ptr<Node>::reclaim_copy(node));
        python = is_python_node(node);
        PyObject* k = PyLong_FromVoidPtr(node);
        PyObject* v = PyLong_FromSsize_t((Py_ssize_t)order.size());
        bool put = k != nullptr && v != nullptr && PyDict_SetItem(ids, k, v) == 0;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (!put) {
          failed = true;
          break;
        }
      } else {
        PyObject* py = nullptr;
        if (obj != nullptr) {
          py = obj;
          Py_INCREF(py);
        } else {
          py = torch::autograd::functionToPyObject(c10::intrusive_ptr<Node>::reclaim_copy(node));
        }
        if (py == nullptr) {
          failed = true;
          break;
        }
        PyObject* k = PyLong_FromVoidPtr(py);
        PyObject* v = PyLong_FromSsize_t((Py_ssize_t)order.size());
        PyDict_SetItem(ids, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        PyList_Append(nodes, py);
        python = THPFunction_Check(py);
        Py_DECREF(py);  // the list holds it
      }
      index.emplace(node, (int32_t)order.size());
      order.push_back(node);
      NameOf name = name_of(node, python);
      uint64_t seq = node->sequence_nr();
      PyObject* s = PyLong_FromUnsignedLongLong(seq);
      PyList_Append(seqs, s);
      Py_DECREF(s);
      int64_t value = 0;
      if (name.accumulate) {
        intptr_t id = 0;
        if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
          if (acc->variable.defined()) {
            PyObject* v = acc->variable.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
            id = (intptr_t)v;
          }
        }
        PyObject* l = PyLong_FromVoidPtr((void*)id);
        PyList_Append(leaves, l);
        Py_DECREF(l);
      } else {
        value = (int64_t)seq - base;
      }
      char part[13];
      std::memcpy(part, &name.id, 4);
      part[4] = python ? 1 : 0;
      std::memcpy(part + 5, &value, 8);
      sig.append(part, 13);
      const auto& edges = node->next_edges();
      for (auto it = edges.rbegin(); it != edges.rend(); ++it)
        if (it->function && !index.count(it->function.get())) stack.emplace_back(it->function.get(), nullptr);
    }
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, what_of(e).c_str());
    failed = true;
  }
  if (failed || PyErr_Occurred()) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "walk(): a Node could not be wrapped");
    Py_XDECREF(nodes);
    Py_XDECREF(seqs);
    Py_XDECREF(leaves);
    Py_XDECREF(ids);
    return nullptr;
  }
  std::vector<int32_t> flat;  // four int32 per edge, native byte order: no Python object per edge here
  for (size_t src = 0; src < order.size(); ++src) {
    const auto& next = order[src]->next_edges();
    for (size_t slot = 0; slot < next.size(); ++slot) {
      if (!next[slot].function) continue;
      flat.push_back((int32_t)src);
      flat.push_back((int32_t)slot);
      flat.push_back(index[next[slot].function.get()]);
      flat.push_back((int32_t)next[slot].input_nr);
    }
  }
  if (lazy) {
    nodes = PyCapsule_New(held.get(), WALK, walk_nodes_free);
    if (nodes == nullptr) {
      Py_DECREF(seqs);
      Py_DECREF(leaves);
      Py_DECREF(ids);
      return nullptr;
    }
    held.release();  // the capsule owns it
  }
  PyObject* edges = PyBytes_FromStringAndSize((const char*)flat.data(), (Py_ssize_t)(flat.size() * 4));
  PyObject* sigb = PyBytes_FromStringAndSize(sig.data(), (Py_ssize_t)sig.size());
  return Py_BuildValue("(NNNNNN)", nodes, edges, seqs, sigb, leaves, ids);
}

WalkNodes* walk_nodes_of(PyObject* o) { return (WalkNodes*)PyCapsule_GetPointer(o, WALK); }

// walk_node(held, i): the Python object of the i-th Node of a lazy walk (made now where it has none)
PyObject* py_walk_node(PyObject*, PyObject* args) {
  PyObject* cap;
  Py_ssize_t i;
  if (!PyArg_ParseTuple(args, "On", &cap, &i)) return nullptr;
  WalkNodes* w = walk_nodes_of(cap);
  if (w == nullptr) return nullptr;
  if (i < 0 || i >= (Py_ssize_t)w->nodes.size()) {
    PyErr_SetString(PyExc_IndexError, "walk_node(): index out of range");
    return nullptr;
  }
  try {
    return torch::autograd::functionToPyObject(w->nodes[i]);
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, what_of(e).c_str());
    return nullptr;
  }
}

// node_address(node): the address of the C++ Node behind a Node's Python object (a lazy walk's key of it)
PyObject* py_node_address(PyObject*, PyObject* o) {
  Node* n = node_of(o);
  if (n == nullptr) {
    PyErr_Format(PyExc_TypeError, "not an autograd Node (%s)", Py_TYPE(o)->tp_name);
    return nullptr;
  }
  return PyLong_FromVoidPtr(n);
}

inline PyObject* none() {
  Py_INCREF(Py_None);
  return Py_None;
}

// ---- Python objects --------------------------------------------------------------------------------------------
const char* STEP = "gradstore.native.Step";
const char* PASS = "gradstore.native.Pass";

void step_free(PyObject* cap) { delete (std::shared_ptr<Step>*)PyCapsule_GetPointer(cap, STEP); }

void pass_free(PyObject* cap) {
  auto* sp = (std::shared_ptr<Pass>*)PyCapsule_GetPointer(cap, PASS);
  if (sp == nullptr) return;
  Pass& p = **sp;
  p.active.store(false);
  {
    std::lock_guard<std::mutex> g(p.step->mu);
    auto& a = p.step->active;
    a.erase(std::remove(a.begin(), a.end(), &p), a.end());
  }
  unregister(p);  // if finish() never ran: the Nodes' hooks drop their references to the pass
  delete sp;
}

std::shared_ptr<Step>* step_of(PyObject* o) {
  return (std::shared_ptr<Step>*)PyCapsule_GetPointer(o, STEP);
}
std::shared_ptr<Pass>* pass_of(PyObject* o) {
  return (std::shared_ptr<Pass>*)PyCapsule_GetPointer(o, PASS);
}

Node* node_of(PyObject* o) {
  if (torch::autograd::THPCppFunction_Check(o)) return ((torch::autograd::THPCppFunction*)o)->cdata.get();
  if (THPFunction_Check(o)) return ((THPFunction*)o)->cdata.get();
  return nullptr;
}

PyObject* py_init(PyObject*, PyObject* args) {
  PyObject *codes, *fallback, *reuse, *tensor_type, *param_type;
  unsigned long long stats;
  long long split;
  long ok, none, r_out, r_in, columns;
  if (!PyArg_ParseTuple(args, "OKOOOOLlllll", &codes, &stats, &fallback, &reuse,
                        &tensor_type, &param_type, &split, &ok, &none, &r_out, &r_in, &columns))
    return nullptr;
  if (columns < 15) {
    PyErr_SetString(PyExc_ValueError, "init(): a row has at least 15 columns after its head");
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(codes, "dtype codes: a sequence of (scalar type, code)");
  if (seq == nullptr) return nullptr;
  std::fill(G.dtype_code, G.dtype_code + 256, (int16_t)-1);
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    int st, code;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ii", &st, &code)) {
      Py_DECREF(seq);
      return nullptr;
    }
    if (st >= 0 && st < 256) G.dtype_code[st] = (int16_t)code;
  }
  Py_DECREF(seq);
  G.stats = (stats_fn)stats;
  Py_XINCREF(fallback);
  Py_XDECREF(G.fallback);
  G.fallback = fallback;
  Py_XINCREF(reuse);
  Py_XDECREF(G.reuse);
  G.reuse = reuse;
  Py_XINCREF(tensor_type);
  Py_XINCREF(param_type);
  G.plain[0] = tensor_type;
  G.plain[1] = param_type;
  G.split = split;
  G.status_ok = ok;
  G.status_none = none;
  G.role_code[R_OUT] = r_out;
  G.role_code[R_IN] = r_in;
  G.columns = columns;
  G.ready = true;
  Py_RETURN_NONE;
}

PyObject* py_scalar_type(PyObject*, PyObject* arg) {
  if (!THPVariable_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "scalar_type(tensor)");
    return nullptr;
  }
  return PyLong_FromLong((long)THPVariable_Unpack(arg).scalar_type());
}

PyObject* py_step(PyObject*, PyObject*) {
  return PyCapsule_New(new std::shared_ptr<Step>(std::make_shared<Step>()), STEP, step_free);
}

PyObject* py_next_seq(PyObject*, PyObject* cap) {
  auto* s = step_of(cap);
  if (s == nullptr) return nullptr;
  return PyLong_FromLongLong((*s)->seq.fetch_add(1));
}

PyObject* py_open_top(PyObject*, PyObject* cap) {
  auto* s = step_of(cap);
  if (s == nullptr) return nullptr;
  for (auto it = t_open.rbegin(); it != t_open.rend(); ++it)
    if (it->step == s->get()) return Py_BuildValue("(iL)", it->pass, (long long)it->seq);
  Py_RETURN_NONE;
}

// install(step, pass number, level, nodes, trusted, claimable, wanted) -> Pass: hooks on every wanted node
PyObject* py_install(PyObject*, PyObject* args) {
  PyObject *scap, *nodes, *trusted, *claimable, *wanted;
  int number, level;
  if (!PyArg_ParseTuple(args, "OiiOO!O!O", &scap, &number, &level, &nodes, &PyList_Type, &trusted,
                        &PyList_Type, &claimable, &wanted))
    return nullptr;
  auto* s = step_of(scap);
  if (s == nullptr) return nullptr;
  if (!G.ready) {
    PyErr_SetString(PyExc_RuntimeError, "gradstore native hooks: init() was not called");
    return nullptr;
  }
  WalkNodes* lazy = PyCapsule_CheckExact(nodes) ? walk_nodes_of(nodes) : nullptr;  // a lazy walk's Nodes
  if (lazy == nullptr && PyErr_Occurred()) return nullptr;
  if (lazy == nullptr && !PyList_Check(nodes)) {
    PyErr_SetString(PyExc_TypeError, "install(): nodes is a list of Nodes or a lazy walk's nodes");
    return nullptr;
  }
  Py_ssize_t n = lazy ? (Py_ssize_t)lazy->nodes.size() : PyList_GET_SIZE(nodes);
  if (PyList_GET_SIZE(trusted) != n || PyList_GET_SIZE(claimable) != n ||
      (wanted != Py_None && (!PyList_Check(wanted) || PyList_GET_SIZE(wanted) != n))) {
    PyErr_SetString(PyExc_ValueError, "install(): trusted, claimable and wanted (or None) need one item per node");
    return nullptr;
  }
  std::vector<Node*> targets(n, nullptr);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (wanted != Py_None && !PyObject_IsTrue(PyList_GET_ITEM(wanted, i))) continue;
    if (lazy) {
      targets[i] = lazy->nodes[i].get();
      continue;
    }
    targets[i] = node_of(PyList_GET_ITEM(nodes, i));
    if (targets[i] == nullptr) {
      PyErr_Format(PyExc_TypeError, "node %zd is not an autograd Node (%s)", i,
                   Py_TYPE(PyList_GET_ITEM(nodes, i))->tp_name);
      return nullptr;
    }
  }
  auto pass = std::make_shared<Pass>();
  Pass& p = *pass;
  p.step = *s;
  p.number = number;
  p.level = (Level)level;
  p.open.assign(n, -1);
  p.trusted.resize(n);
  p.claimable.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    p.trusted[i] = PyObject_IsTrue(PyList_GET_ITEM(trusted, i)) ? 1 : 0;
    p.claimable[i] = PyObject_IsTrue(PyList_GET_ITEM(claimable, i)) ? 1 : 0;
  }
  p.t0 = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> g(p.step->mu);
    p.step->active.push_back(&p);
  }
  auto* holder = new std::shared_ptr<Pass>(pass);
  PyObject* cap = PyCapsule_New(holder, PASS, pass_free);
  if (cap == nullptr) {
    delete holder;
    return nullptr;
  }
  try {
    std::lock_guard<std::mutex> g(g_install);
    for (Py_ssize_t i = 0; i < n; ++i) {
      Node* node = targets[i];
      if (node == nullptr) continue;
      auto d = dispatch_of(node);
      {
        std::lock_guard<std::mutex> dg(d->mu);
        d->passes.emplace_back(pass, (int32_t)i);
      }
      p.hooked.emplace_back(c10::intrusive_ptr<Node>::reclaim_copy(node), std::move(d));
    }
  } catch (const std::exception& e) {
    Py_DECREF(cap);  // removes what was added
    PyErr_SetString(PyExc_RuntimeError, what_of(e).c_str());
    return nullptr;
  }
  return cap;
}

// finish(pass) -> (calls count, results count, fallbacks [objects], measured, reused, faults [str],
// nonfinite: whether a result measured here counts a NaN or an infinity): the hooks are removed; the calls
// and results stay in the pass for call_rows() and rows()
PyObject* py_finish(PyObject*, PyObject* cap) {
  auto* sp = pass_of(cap);
  if (sp == nullptr) return nullptr;
  Pass& p = **sp;
  p.active.store(false);
  {
    std::lock_guard<std::mutex> g(p.step->mu);
    auto& a = p.step->active;
    a.erase(std::remove(a.begin(), a.end(), &p), a.end());
  }
  unregister(p);
  t_open.erase(std::remove_if(t_open.begin(), t_open.end(),
                              [&](const Open& o) { return o.step == p.step.get() && o.pass == p.number; }),
               t_open.end());
  std::lock_guard<std::mutex> lock(p.mu);
  p.seen.clear();
  PyObject* fallbacks = PyList_New(0);
  bool nonfinite = false;
  for (const Entry& e : p.entries) {
    if (e.r.kind == K_PY) PyList_Append(fallbacks, e.r.py);
    if (e.r.kind == K_STATS && (e.r.vec[0] != 0 || e.r.vec[1] != 0 || e.r.vec[2] != 0)) nonfinite = true;
  }
  PyObject* faults = PyList_New(0);
  for (const auto& f : p.faults) {
    PyObject* s = PyUnicode_FromString(f.c_str());
    PyList_Append(faults, s);
    Py_DECREF(s);
  }
  return Py_BuildValue("(nnNLLNO)", (Py_ssize_t)p.calls.size(), (Py_ssize_t)p.entries.size(), fallbacks,
                       (long long)p.measured, (long long)p.reused, faults, nonfinite ? Py_True : Py_False);
}

// a row tuple whose items are all None, int, float, str or bytes can be part of no reference cycle: it leaves the
// garbage collector's lists (as CPython does for such a tuple at its first collection, `_PyTuple_MaybeUntrack`, but
// at once and for the Row subclass too), so the rows of a step that lives until it is written are never traversed
// or promoted by a collection
void untrack_if_atomic(PyObject* row) {
  if (Py_TYPE(row)->tp_dictoffset != 0) return;  // a subclass with a __dict__ may hold anything
  Py_ssize_t n = PyTuple_GET_SIZE(row);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* x = PyTuple_GET_ITEM(row, k);
    if (x == nullptr) return;
    if (x != Py_None && !PyLong_CheckExact(x) && !PyFloat_CheckExact(x) && !PyUnicode_CheckExact(x) &&
        !PyBytes_CheckExact(x) && !PyBool_Check(x))
      return;
  }
  if (PyObject_GC_IsTracked(row)) PyObject_GC_UnTrack(row);
}

// a call's node's sequence_nr (`Node::sequence_nr`, what `grad_fn._sequence_nr()` returns) from `seqs`, the pass
// walk's number per node index (a list, or None: none known): that int where it is a number, 0 <= n < 2**63;
// None for AccumulateGrad's 2**64-1 (one value for every such node), -1 (not read) and a node past the list
// (rows.sequence_nr in Python). A new reference.
PyObject* sequence_nr_of(PyObject* seqs, int32_t node) {
  if (seqs == Py_None || node < 0 || node >= PyList_GET_SIZE(seqs)) return none();
  PyObject* v = PyList_GET_ITEM(seqs, node);
  if (!PyLong_CheckExact(v)) return none();
  int overflow = 0;
  long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (n == -1 && PyErr_Occurred()) PyErr_Clear();
  if (overflow != 0 || n < 0) return none();
  Py_INCREF(v);
  return v;
}

// one call row: (node key, seq, start s, duration s or None: a call still running, sequence_nr or None); seqnr: a
// new reference (sequence_nr_of), taken over
PyObject* call_row(PyObject* key, int64_t seq, double start, bool ended, double dur, PyObject* seqnr) {
  PyObject* row = PyTuple_New(5);
  if (row == nullptr) {
    Py_DECREF(seqnr);
    return nullptr;
  }
  Py_INCREF(key);
  PyTuple_SET_ITEM(row, 0, key);
  PyTuple_SET_ITEM(row, 1, PyLong_FromLongLong(seq));
  PyTuple_SET_ITEM(row, 2, PyFloat_FromDouble(start));
  PyTuple_SET_ITEM(row, 3, ended ? PyFloat_FromDouble(dur) : none());
  PyTuple_SET_ITEM(row, 4, seqnr);
  untrack_if_atomic(row);
  return row;
}

// the `seqs` argument of call_rows / unpack_calls: a list, or None
bool seqs_arg(PyObject* seqs, const char* what) {
  if (seqs == Py_None || PyList_Check(seqs)) return true;
  PyErr_Format(PyExc_TypeError, "%s(): seqs is a list of sequence numbers by node index, or None", what);
  return false;
}

// call_rows(pass, keys, seqs) -> [(node key, seq, start s, duration s or None, sequence_nr or None)] in call order
// (rows.call_rows of the Python hooks' calls); seqs: the pass walk's sequence_nr per node index, or None; after
// finish()
PyObject* py_call_rows(PyObject*, PyObject* args) {
  PyObject *cap, *keys, *seqs;
  if (!PyArg_ParseTuple(args, "OO!O", &cap, &PyList_Type, &keys, &seqs)) return nullptr;
  if (!seqs_arg(seqs, "call_rows")) return nullptr;
  auto* sp = pass_of(cap);
  if (sp == nullptr) return nullptr;
  Pass& p = **sp;
  std::lock_guard<std::mutex> lock(p.mu);
  PyObject* out = PyList_New((Py_ssize_t)p.calls.size());
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < p.calls.size(); ++i) {
    const Call& c = p.calls[i];
    if (c.node < 0 || c.node >= PyList_GET_SIZE(keys)) {
      Py_DECREF(out);
      PyErr_SetString(PyExc_IndexError, "call_rows(): a call's node has no key");
      return nullptr;
    }
    PyObject* row =
        call_row(PyList_GET_ITEM(keys, c.node), c.seq, c.start, c.ended, c.dur, sequence_nr_of(seqs, c.node));
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, row);
  }
  return out;
}

PyObject* shape_string(const Result& r) {
  std::string s;
  for (size_t i = 0; i < r.sizes.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(r.sizes[i]);
  }
  return PyUnicode_FromStringAndSize(s.data(), (Py_ssize_t)s.size());
}

// the statistics columns of gradstore.recording.stats._derive (norm, min, max, mean, std, nan, posinf, neginf, zeros)
void derive(const double* v, PyObject* row, int at) {
  long long nfinite = (long long)v[4];
  bool has = nfinite > 0;
  double zeros = v[3], sd = v[9];
  PyTuple_SET_ITEM(row, at, PyFloat_FromDouble(v[5]));
  PyTuple_SET_ITEM(row, at + 1, has ? PyFloat_FromDouble(v[6]) : none());
  PyTuple_SET_ITEM(row, at + 2, has ? PyFloat_FromDouble(v[7]) : none());
  PyTuple_SET_ITEM(row, at + 3, has && !std::isnan(v[8]) ? PyFloat_FromDouble(v[8]) : none());
  PyTuple_SET_ITEM(row, at + 4, nfinite > 1 && !std::isnan(sd) ? PyFloat_FromDouble(sd) : none());
  PyTuple_SET_ITEM(row, at + 5, PyLong_FromLongLong((long long)v[0]));
  PyTuple_SET_ITEM(row, at + 6, PyLong_FromLongLong((long long)v[1]));
  PyTuple_SET_ITEM(row, at + 7, PyLong_FromLongLong((long long)v[2]));
  PyTuple_SET_ITEM(row, at + 8, std::isnan(zeros) ? none() : PyLong_FromLongLong((long long)zeros));
}

// the ROW_COLUMNS items and the sharding (G.columns items) of a result measured here (K_NONE, K_SHAPE, K_STATS)
// into row[at:], as gradstore.recording.stats.to_rows makes them
void fill_row(PyObject* row, int at, const Result& r) {
  if (r.kind == K_NONE) {
    PyTuple_SET_ITEM(row, at, PyLong_FromLong(G.status_none));
    for (int k = at + 1; k < at + 15; ++k) PyTuple_SET_ITEM(row, k, none());
  } else {
    PyTuple_SET_ITEM(row, at, PyLong_FromLong(G.status_ok));
    PyTuple_SET_ITEM(row, at + 1, none());
    PyTuple_SET_ITEM(row, at + 2, PyLong_FromLong(r.dtype));
    PyTuple_SET_ITEM(row, at + 3, shape_string(r));
    PyTuple_SET_ITEM(row, at + 4, PyLong_FromLongLong(r.numel));
    if (r.kind == K_STATS) {
      derive(r.vec, row, at + 5);
    } else if (r.numel == 0) {  // _EMPTY_STATS
      PyTuple_SET_ITEM(row, at + 5, PyFloat_FromDouble(0.0));
      for (int k = at + 6; k < at + 10; ++k) PyTuple_SET_ITEM(row, k, none());
      for (int k = at + 10; k < at + 14; ++k) PyTuple_SET_ITEM(row, k, PyLong_FromLong(0));
    } else {
      for (int k = at + 5; k < at + 14; ++k) PyTuple_SET_ITEM(row, k, none());
    }
    PyTuple_SET_ITEM(row, at + 14, none());  // checksum
  }
  // layout, nnz, coalesced (a dense tensor's: None), then the sharding (a plain tensor's: None; a DTensor is
  // measured in Python)
  for (long k = at + 15; k < at + G.columns; ++k) PyTuple_SET_ITEM(row, k, none());
}

// one item of param_rows' / param_pack's list into r: None is K_NONE; a tensor the C++ side measures itself is
// measured; false for anything else (a tensor subclass, a device tensor, a tensor that throws while read, not a
// tensor): the caller hands it to the Python measurement
bool measure_item(PyObject* item, Level level, Result& r) {
  if (item == Py_None) return true;  // K_NONE
  if (!THPVariable_Check(item)) return false;
  try {
    return measure_here(THPVariable_Unpack(item), level, r);
  } catch (const std::exception&) {
    return false;
  }
}

// param_rows(tensors, level, row_type) -> [row or None]: per item of the list (a tensor or None: the parameters'
// `.grad`s), the ROW_COLUMNS items and the sharding as `stats.to_rows(stats.measure_many(...))` makes them, built
// here as instances of row_type (a tuple subclass), or None where the C++ side does not measure that tensor itself
// (the caller measures it in Python). No checksum is taken. With the GIL held; the kernel reads each tensor once.
PyObject* py_param_rows(PyObject*, PyObject* args) {
  PyObject *tensors, *row_type;
  int level;
  if (!PyArg_ParseTuple(args, "O!iO!", &PyList_Type, &tensors, &level, &PyType_Type, &row_type)) return nullptr;
  if (!PyType_IsSubtype((PyTypeObject*)row_type, &PyTuple_Type) || level < SHAPE || level > FULL) {
    PyErr_SetString(PyExc_TypeError, "param_rows(tensors, level, row_type): a level code and a tuple subclass");
    return nullptr;
  }
  PyTypeObject* rt = (PyTypeObject*)row_type;
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    Result r;
    bool here = measure_item(PyList_GET_ITEM(tensors, i), (Level)level, r);
    PyObject* row;
    if (here) {
      row = rt->tp_alloc(rt, G.columns);
      if (row == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      fill_row(row, 0, r);
      untrack_if_atomic(row);
    } else {
      row = none();
    }
    PyList_SET_ITEM(out, i, row);
  }
  return out;
}

// a packed row's seq where the row has none (a param_grad row: param_pack): its row's seq is None
constexpr int64_t NO_SEQ = INT64_MIN;

// one tensor row: (key, seq (None for NO_SEQ), role code, slot, *ROW_COLUMNS, sharding); a K_PY result takes the
// next of the fallback rows `fb` (the ROW_COLUMNS tuples of finish()'s fallbacks, in order:
// gradstore.recording.stats.to_rows). nullptr with an exception set on an error.
PyObject* tensor_row(PyObject* key, int64_t seq, long role, long slot, const Result& r, PyObject* fb,
                     Py_ssize_t& next_fb) {
  PyObject* row;
  if (r.kind == K_PY) {
    if (next_fb >= PyList_GET_SIZE(fb)) {
      PyErr_SetString(PyExc_ValueError, "rows(): fewer fallback rows than fallbacks");
      return nullptr;
    }
    PyObject* tail = PyList_GET_ITEM(fb, next_fb++);
    if (!PyTuple_Check(tail)) {
      PyErr_SetString(PyExc_TypeError, "rows(): a fallback row is a tuple");
      return nullptr;
    }
    Py_ssize_t nt = PyTuple_GET_SIZE(tail);
    row = PyTuple_New(4 + nt);
    if (row == nullptr) return nullptr;
    for (Py_ssize_t k = 0; k < nt; ++k) {
      PyObject* x = PyTuple_GET_ITEM(tail, k);
      Py_INCREF(x);
      PyTuple_SET_ITEM(row, 4 + k, x);
    }
  } else {
    row = PyTuple_New(4 + G.columns);
    if (row == nullptr) return nullptr;
    fill_row(row, 4, r);
  }
  Py_INCREF(key);
  PyTuple_SET_ITEM(row, 0, key);
  PyTuple_SET_ITEM(row, 1, seq == NO_SEQ ? none() : PyLong_FromLongLong(seq));
  PyTuple_SET_ITEM(row, 2, PyLong_FromLong(role));
  PyTuple_SET_ITEM(row, 3, PyLong_FromLong(slot));
  untrack_if_atomic(row);
  return row;
}

// rows(pass, keys, fallback_rows) -> [(node key, seq, role code, slot, *stats.ROW_COLUMNS, sharding)] in hook order;
// fallback_rows: the ROW_COLUMNS tuples of finish()'s fallbacks, in order (gradstore.recording.stats.to_rows)
PyObject* py_rows(PyObject*, PyObject* args) {
  PyObject *cap, *keys, *fb;
  if (!PyArg_ParseTuple(args, "OO!O!", &cap, &PyList_Type, &keys, &PyList_Type, &fb)) return nullptr;
  auto* sp = pass_of(cap);
  if (sp == nullptr) return nullptr;
  Pass& p = **sp;
  std::lock_guard<std::mutex> lock(p.mu);
  PyObject* out = PyList_New((Py_ssize_t)p.entries.size());
  if (out == nullptr) return nullptr;
  Py_ssize_t next_fb = 0;
  for (size_t i = 0; i < p.entries.size(); ++i) {
    const Entry& e = p.entries[i];
    const Call& c = p.calls[e.call];
    if (c.node < 0 || c.node >= PyList_GET_SIZE(keys)) {
      Py_DECREF(out);
      PyErr_SetString(PyExc_IndexError, "rows(): a call's node has no key");
      return nullptr;
    }
    PyObject* row = tensor_row(PyList_GET_ITEM(keys, c.node), c.seq, G.role_code[e.role], e.slot, e.r, fb, next_fb);
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, row);
  }
  return out;
}

// ---- packed rows: what rows() and call_rows() build, as bytes (the form a step takes to the writer's child) ----
// A tensor row: PackedHead, then `ndim` int64 sizes. A call row: PackedCall. Native byte order and layout: the bytes
// are read by the same build (unpack_rows / unpack_calls) or by gradstore.recording.rows, on the same machine.
struct PackedHead {
  int32_t node, role, slot, kind;  // node index (a key of `keys`), role code, slot, Kind
  int64_t seq, numel;
  int32_t dtype, ndim;
  double vec[10];
};
struct PackedCall {
  int32_t node, ended;
  int64_t seq;
  double start, dur;
};
static_assert(sizeof(PackedHead) == 120, "PackedHead: 120 bytes, no padding");
static_assert(sizeof(PackedCall) == 32, "PackedCall: 32 bytes, no padding");

// pack(pass) -> (tensor rows bytes, call rows bytes); after finish()
PyObject* py_pack(PyObject*, PyObject* cap) {
  auto* sp = pass_of(cap);
  if (sp == nullptr) return nullptr;
  Pass& p = **sp;
  std::string t, c;
  try {
    std::lock_guard<std::mutex> lock(p.mu);
    size_t dims = 0;
    for (const Entry& e : p.entries) dims += e.r.sizes.size();
    t.reserve(p.entries.size() * sizeof(PackedHead) + dims * 8);
    for (const Entry& e : p.entries) {
      const Call& call = p.calls[e.call];
      PackedHead h;
      h.node = call.node;
      h.role = (int32_t)G.role_code[e.role];
      h.slot = e.slot;
      h.kind = e.r.kind;
      h.seq = call.seq;
      h.numel = e.r.numel;
      h.dtype = e.r.dtype;
      h.ndim = (int32_t)e.r.sizes.size();
      std::copy(e.r.vec, e.r.vec + 10, h.vec);
      t.append((const char*)&h, sizeof h);
      if (h.ndim) t.append((const char*)e.r.sizes.data(), (size_t)h.ndim * 8);
    }
    c.reserve(p.calls.size() * sizeof(PackedCall));
    for (const Call& call : p.calls) {
      PackedCall pc{call.node, call.ended ? 1 : 0, call.seq, call.start, call.dur};
      c.append((const char*)&pc, sizeof pc);
    }
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  PyObject* tb = PyBytes_FromStringAndSize(t.data(), (Py_ssize_t)t.size());
  PyObject* cb = PyBytes_FromStringAndSize(c.data(), (Py_ssize_t)c.size());
  if (tb == nullptr || cb == nullptr) {
    Py_XDECREF(tb);
    Py_XDECREF(cb);
    return nullptr;
  }
  PyObject* out = PyTuple_Pack(2, tb, cb);
  Py_DECREF(tb);
  Py_DECREF(cb);
  return out;
}

// param_pack(tensors, level, role) -> (bytes, declined, norms, counts): the parameters' `.grad`s (a list of tensors or
// None) measured here as param_rows measures them, each as one packed tensor row (node: its index in the list, the
// role code given, slot 0, seq NO_SEQ: unpack_rows gives each the row param_rows's item would have, after the
// caller's (key, None, role, 0)). declined: the indices, in order, of the tensors the C++ side does not measure (a
// K_PY row each: the caller measures them in Python and hands their rows to unpack_rows as the fallbacks). norms and
// counts, per tensor: the row's norm and its NaN + Inf count (None where the row has none, and for a declined
// tensor), what gradstore.recording.flight.summary_norms reads from the rows. With the GIL held; no Python object per
// tensor but the norms and counts (floats and ints, which the garbage collector does not track).
PyObject* py_param_pack(PyObject*, PyObject* args) {
  PyObject* tensors;
  int level, role;
  if (!PyArg_ParseTuple(args, "O!ii", &PyList_Type, &tensors, &level, &role)) return nullptr;
  if (level < SHAPE || level > FULL) {
    PyErr_SetString(PyExc_ValueError, "param_pack(tensors, level, role): a level code");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  std::string t;
  PyObject* declined = PyList_New(0);
  PyObject* norms = PyList_New(n);
  PyObject* counts = PyList_New(n);
  if (declined == nullptr || norms == nullptr || counts == nullptr) {
    Py_XDECREF(declined);
    Py_XDECREF(norms);
    Py_XDECREF(counts);
    return nullptr;
  }
  bool failed = false;
  try {
    t.reserve((size_t)n * (sizeof(PackedHead) + 16));
    for (Py_ssize_t i = 0; i < n && !failed; ++i) {
      Result r;
      bool here = measure_item(PyList_GET_ITEM(tensors, i), (Level)level, r);
      PackedHead h;
      h.node = (int32_t)i;
      h.role = role;
      h.slot = 0;
      h.kind = here ? r.kind : K_PY;
      h.seq = NO_SEQ;
      h.numel = here ? r.numel : 0;
      h.dtype = here ? r.dtype : 0;
      h.ndim = here ? (int32_t)r.sizes.size() : 0;
      std::copy(r.vec, r.vec + 10, h.vec);
      t.append((const char*)&h, sizeof h);
      if (h.ndim) t.append((const char*)r.sizes.data(), (size_t)h.ndim * 8);
      PyObject *norm, *count;
      if (here && r.kind == K_STATS) {  // derive(): the norm always, the NaN/Inf counts as ints
        norm = PyFloat_FromDouble(r.vec[5]);
        count = PyLong_FromLongLong((long long)r.vec[0] + (long long)r.vec[1] + (long long)r.vec[2]);
      } else if (here && r.kind == K_SHAPE && r.numel == 0) {  // _EMPTY_STATS
        norm = PyFloat_FromDouble(0.0);
        count = PyLong_FromLong(0);
      } else {
        norm = none();
        count = none();
        if (!here) {
          PyObject* at = PyLong_FromSsize_t(i);
          if (at == nullptr || PyList_Append(declined, at) < 0) failed = true;
          Py_XDECREF(at);
        }
      }
      if (norm == nullptr || count == nullptr) failed = true;
      PyList_SET_ITEM(norms, i, norm ? norm : none());
      PyList_SET_ITEM(counts, i, count ? count : none());
    }
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    failed = true;
  }
  PyObject* blob = failed ? nullptr : PyBytes_FromStringAndSize(t.data(), (Py_ssize_t)t.size());
  PyObject* out = blob ? PyTuple_Pack(4, blob, declined, norms, counts) : nullptr;
  Py_XDECREF(blob);
  Py_DECREF(declined);
  Py_DECREF(norms);
  Py_DECREF(counts);
  return out;
}

// unpack_rows(tensor rows bytes, keys, fallback_rows) -> the rows rows() gave for the pass pack() read
PyObject* py_unpack_rows(PyObject*, PyObject* args) {
  Py_buffer buf;
  PyObject *keys, *fb;
  if (!PyArg_ParseTuple(args, "y*O!O!", &buf, &PyList_Type, &keys, &PyList_Type, &fb)) return nullptr;
  const char* at = (const char*)buf.buf;
  const char* end = at + buf.len;
  PyObject* out = PyList_New(0);
  Py_ssize_t next_fb = 0;
  const char* error = nullptr;
  while (out != nullptr && at < end) {
    PackedHead h;
    if (end - at < (Py_ssize_t)sizeof h) {
      error = "unpack_rows(): the bytes end inside a row";
      break;
    }
    std::memcpy(&h, at, sizeof h);
    at += sizeof h;
    if (h.ndim < 0 || end - at < (Py_ssize_t)h.ndim * 8 || h.kind < K_NONE || h.kind > K_PY) {
      error = "unpack_rows(): not rows pack() made";
      break;
    }
    if (h.node < 0 || h.node >= PyList_GET_SIZE(keys)) {
      error = "unpack_rows(): a row's node has no key";
      break;
    }
    Result r;
    r.kind = (Kind)h.kind;
    r.dtype = (int16_t)h.dtype;
    r.numel = h.numel;
    r.sizes.resize((size_t)h.ndim);
    if (h.ndim) std::memcpy(r.sizes.data(), at, (size_t)h.ndim * 8);
    at += (size_t)h.ndim * 8;
    std::copy(h.vec, h.vec + 10, r.vec);
    PyObject* row = tensor_row(PyList_GET_ITEM(keys, h.node), h.seq, h.role, h.slot, r, fb, next_fb);
    if (row == nullptr || PyList_Append(out, row) < 0) {
      Py_XDECREF(row);
      Py_CLEAR(out);
      break;
    }
    Py_DECREF(row);
  }
  PyBuffer_Release(&buf);
  if (error != nullptr) {
    Py_XDECREF(out);
    PyErr_SetString(PyExc_ValueError, error);
    return nullptr;
  }
  return out;
}

// unpack_calls(call rows bytes, keys, seqs) -> the rows call_rows() gave for the pass pack() read, with the same seqs
PyObject* py_unpack_calls(PyObject*, PyObject* args) {
  Py_buffer buf;
  PyObject *keys, *seqs;
  if (!PyArg_ParseTuple(args, "y*O!O", &buf, &PyList_Type, &keys, &seqs)) return nullptr;
  if (!seqs_arg(seqs, "unpack_calls")) {
    PyBuffer_Release(&buf);
    return nullptr;
  }
  if (buf.len % (Py_ssize_t)sizeof(PackedCall) != 0) {
    PyBuffer_Release(&buf);
    PyErr_SetString(PyExc_ValueError, "unpack_calls(): not calls pack() made");
    return nullptr;
  }
  Py_ssize_t n = buf.len / (Py_ssize_t)sizeof(PackedCall);
  PyObject* out = PyList_New(n);
  for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
    PackedCall c;
    std::memcpy(&c, (const char*)buf.buf + i * (Py_ssize_t)sizeof c, sizeof c);
    if (c.node < 0 || c.node >= PyList_GET_SIZE(keys)) {
      Py_CLEAR(out);
      PyErr_SetString(PyExc_IndexError, "unpack_calls(): a call's node has no key");
      break;
    }
    PyObject* row =
        call_row(PyList_GET_ITEM(keys, c.node), c.seq, c.start, c.ended != 0, c.dur, sequence_nr_of(seqs, c.node));
    if (row == nullptr) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, i, row);
  }
  PyBuffer_Release(&buf);
  return out;
}

// W int64 words per (name, parameter) of the list `params`, written by `fill(grad, words)` from the parameter's
// `.grad` (an undefined tensor for None), as bytes; None where an item is not such a pair of a plain
// torch.Tensor / nn.Parameter (whose `.grad` Python code may compute) or reading it faults. `what` names the caller
// in the TypeError for a `params` that is not a list. Read without a Python object per parameter.
template <int W, typename Fill>
PyObject* grad_words(PyObject* params, const char* what, Fill fill) {
  if (!PyList_Check(params)) {
    PyErr_Format(PyExc_TypeError, "%s(params): a list of (name, parameter)", what);
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(params);
  std::string out((size_t)n * W * 8, '\0');
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(params, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) Py_RETURN_NONE;
    PyObject* p = PyTuple_GET_ITEM(item, 1);
    if ((PyObject*)Py_TYPE(p) != G.plain[0] && (PyObject*)Py_TYPE(p) != G.plain[1]) Py_RETURN_NONE;
    int64_t words[W];
    try {
      fill(THPVariable_Unpack(p).grad(), words);
    } catch (const std::exception&) {
      Py_RETURN_NONE;
    }
    std::memcpy(&out[(size_t)i * W * 8], words, W * 8);
  }
  return PyBytes_FromStringAndSize(out.data(), (Py_ssize_t)out.size());
}

// grad_states(params) -> bytes, or None (grad_words): two int64 per parameter: (0, -2) for a `.grad` of None, (data
// pointer, version counter) for a `.grad` with storage and a version, (its TensorImpl's address, version counter)
// for a sparse one (COO, CSR, CSC, BSR, BSC: no storage of its own; accumulating into it, zero_() and any other
// in-place op move its counter), else (its TensorImpl's address, -1). What tells that a `.grad` changed
// (gradstore.recording.passes).
PyObject* py_grad_states(PyObject*, PyObject* params) {
  return grad_words<2>(params, "grad_states", [](const at::Tensor& grad, int64_t* w) {
    w[0] = 0;
    w[1] = -2;
    if (!grad.defined()) return;
    c10::TensorImpl* impl = grad.unsafeGetTensorImpl();
    w[0] = (int64_t)(intptr_t)impl;
    w[1] = -1;
    if (impl->is_inference() || impl->is_python_dispatch()) return;
    if (impl->has_storage()) {
      w[0] = (int64_t)(intptr_t)grad.data_ptr();
      w[1] = (int64_t)impl->version_counter().current_version();
    } else if (impl->is_sparse() || impl->is_sparse_compressed()) {
      w[1] = (int64_t)impl->version_counter().current_version();
    }
  });
}

// grad_impls(params) -> bytes, or None (grad_words): the address of each parameter's `.grad` TensorImpl (0 for
// None), one int64 each. With grad_states' data pointer and version counter it tells a `.grad` replaced by another
// tensor over the same memory (a view with other strides) without an operator (gradstore.recording.final_grads).
PyObject* py_grad_impls(PyObject*, PyObject* params) {
  return grad_words<1>(params, "grad_impls", [](const at::Tensor& grad, int64_t* w) {
    w[0] = grad.defined() ? (int64_t)(intptr_t)grad.unsafeGetTensorImpl() : 0;
  });
}

// ---- the operator watch (gradstore.recording.final_grads): PyTorch operators run between two points ---------------
// A global RecordFunction callback (every thread) counts the operators the dispatcher runs while at least one
// watcher is on. ops_watch(True) adds a watcher (registering the callback for the first) and returns the count so far,
// or -1 where RecordFunction is off on this thread (nothing to count with: no watcher is added); ops_watch(False)
// removes one (the callback goes with the last) and returns the count, or -1 where none was on. The count only grows: a watcher's operators
// are its two readings' difference, whatever other watchers do. Not counted: torch.profiler.record_function's own
// enter / exit operators, and the USER_SCOPE records named 'Optimizer.*' that torch.optim opens around step() and
// zero_grad() before their hooks run (the operators inside them are counted). ops_watch(None), in a forked child,
// removes the callback and every watcher the parent had. Called with the GIL.
std::atomic<int64_t> g_ops_seen{0};
int g_ops_watchers = 0;
at::CallbackHandle g_ops_handle = 0;

std::unique_ptr<at::ObserverContext> ops_seen(const at::RecordFunction& fn) {
  const char* name = fn.name();
  if (name != nullptr) {
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      if (std::strncmp(name, "Optimizer.", 10) == 0) return nullptr;
    } else if (std::strncmp(name, "profiler::_record_function", 26) == 0) {
      return nullptr;
    }
  }
  g_ops_seen.fetch_add(1, std::memory_order_relaxed);
  return nullptr;
}

PyObject* py_ops_watch(PyObject*, PyObject* on) {
  if (on == Py_None) {  // a forked child: the parent's watchers are not its own; the callback goes
    try {
      if (g_ops_watchers > 0) at::removeCallback(g_ops_handle);
    } catch (const std::exception&) {
    }
    g_ops_watchers = 0;
    Py_RETURN_NONE;
  }
  int start = PyObject_IsTrue(on);
  if (start < 0) return nullptr;
  try {
    if (start) {
      if (!at::isRecordFunctionEnabled()) return PyLong_FromLong(-1);
      if (g_ops_watchers == 0)
        g_ops_handle = at::addGlobalCallback(at::RecordFunctionCallback(ops_seen).needsInputs(false).needsIds(false));
      ++g_ops_watchers;
    } else if (g_ops_watchers == 0) {
      return PyLong_FromLong(-1);
    } else if (--g_ops_watchers == 0) {
      at::removeCallback(g_ops_handle);
    }
    return PyLong_FromLongLong((long long)g_ops_seen.load(std::memory_order_relaxed));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// ---- the writer's tensor_data rows (gradstore.store.writer.Writer._write_calls_and_tensors) ------------------------
// tensor_rows(tensors, pass_id, step_id, tids, k, node_id, layouts, call_of, forward_roles, rows, notes, unknown,
// sharded, seqs) -> the next k, or None: the writer's loop over one source of tensor rows (a pass's, the activations',
// the final ones), done here: for each row (key, seq, role, slot, status, reason, dtype, shape, numel, norm, min, max,
// mean, std, nan, posinf, neginf, zeros, checksum, layout, nnz, coalesced, sharding) with id tids[k], the
// tensor_data row (step_id, id, pass_id or None, call id or None, node id, role, slot, status, layout id, norm or
// None where the view derives it bit for bit, min ... zeros) appended to `rows`, and what the loop appends to
// `notes`, `unknown`, `sharded` and `seqs`, the same as the Python loop does. Nothing is appended and None is
// returned where a row is not what the common path reads (not a 23-tuple, a key without a node id, a count or
// statistic of another type): the Python loop then takes the whole source.
PyObject* py_tensor_rows(PyObject*, PyObject* args) {
  PyObject *tensors, *pass_id, *step_id, *tids, *node_id, *layouts, *call_of, *forward_roles;
  PyObject *rows, *notes, *unknown, *sharded, *seqs;
  Py_ssize_t k;
  if (!PyArg_ParseTuple(args, "OOOOnO!O!O!OO!O!O!O!O!", &tensors, &pass_id, &step_id, &tids, &k, &PyDict_Type,
                        &node_id, &PyDict_Type, &layouts, &PyDict_Type, &call_of, &forward_roles, &PyList_Type, &rows,
                        &PyList_Type, &notes, &PyList_Type, &unknown, &PyList_Type, &sharded, &PyList_Type, &seqs))
    return nullptr;
  PyObject* items = PySequence_Fast(tensors, "tensor rows");
  if (items == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  PyObject** at = PySequence_Fast_ITEMS(items);
  // built apart, handed over only once every row went through
  PyObject* out[5] = {PyList_New(0), PyList_New(0), PyList_New(0), PyList_New(0), PyList_New(0)};
  enum { ROWS, NOTES, UNKNOWN, SHARDED, SEQS };
  bool ok = out[0] && out[1] && out[2] && out[3] && out[4];
  bool declined = false;
  for (Py_ssize_t r = 0; ok && !declined && r < n; ++r) {
    PyObject* t = at[r];
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 23) {
      declined = true;
      break;
    }
    PyObject* const* v = &PyTuple_GET_ITEM(t, 0);
    PyObject *key = v[0], *seq = v[1], *role = v[2], *slot = v[3], *status = v[4], *reason = v[5];
    PyObject *dtype = v[6], *shape = v[7], *numel = v[8], *norm = v[9], *mn = v[10], *mx = v[11], *mean = v[12];
    PyObject *std_ = v[13], *nan = v[14], *pinf = v[15], *ninf = v[16], *zeros = v[17], *csum = v[18];
    PyObject *tlayout = v[19], *nnz = v[20], *coalesced = v[21], *sharding = v[22];
    PyObject* node = PyDict_GetItemWithError(node_id, key);  // borrowed
    if (node == nullptr) {
      if (PyErr_Occurred()) ok = false;
      declined = true;  // the Python loop raises the KeyError, as it always did
      break;
    }
    PyObject* tid = PySequence_GetItem(tids, k);
    if (tid == nullptr) {
      ok = false;
      break;
    }
    PyObject* lkey = PyTuple_Pack(3, dtype, shape, numel);
    PyObject* lay = lkey != nullptr ? PyDict_GetItemWithError(layouts, lkey) : nullptr;  // borrowed
    Py_XDECREF(lkey);
    if (lay == nullptr && PyErr_Occurred()) {
      Py_DECREF(tid);
      ok = false;
      break;
    }
    if (lay == nullptr) {
      lay = Py_None;
      if (dtype != Py_None || shape != Py_None || numel != Py_None) {
        PyObject* kk = PyLong_FromSsize_t(k);
        ok = kk != nullptr && PyList_Append(out[UNKNOWN], kk) == 0;
        Py_XDECREF(kk);
      }
    }
    PyObject* stored_norm = norm;
    if (ok && std_ != Py_None && mean != Py_None && norm != Py_None && numel != Py_None) {
      if (!PyFloat_CheckExact(std_) || !PyFloat_CheckExact(mean) || !PyFloat_CheckExact(norm) ||
          !PyLong_CheckExact(numel) || !PyLong_CheckExact(nan) || !PyLong_CheckExact(pinf) || !PyLong_CheckExact(ninf)) {
        Py_DECREF(tid);
        declined = true;
        break;
      }
      int o1 = 0, o2 = 0, o3 = 0, o4 = 0;
      long long c = PyLong_AsLongLongAndOverflow(numel, &o1) - PyLong_AsLongLongAndOverflow(nan, &o2) -
                    PyLong_AsLongLongAndOverflow(pinf, &o3) - PyLong_AsLongLongAndOverflow(ninf, &o4);
      if (o1 || o2 || o3 || o4 || PyErr_Occurred()) {
        PyErr_Clear();
        Py_DECREF(tid);
        declined = true;
        break;
      }
      if (c > 0) {
        double sd = PyFloat_AS_DOUBLE(std_), mu = PyFloat_AS_DOUBLE(mean);
        double a = (double)(c - 1) * sd * sd;  // as Python: int * float, left to right
        double b = (double)c * mu * mu;
        if (std::sqrt(a + b) == PyFloat_AS_DOUBLE(norm)) stored_norm = Py_None;
      }
    }
    PyObject* cid = Py_None;
    if (ok && pass_id != Py_None) {
      PyObject* got = PyDict_GetItemWithError(call_of, seq);
      if (got == nullptr && PyErr_Occurred()) ok = false;
      if (got != nullptr) cid = got;
    }
    if (ok && cid == Py_None) {
      int forward = PySequence_Contains(forward_roles, role);
      if (forward < 0) ok = false;
      if (forward > 0) {
        PyObject* pair = PyTuple_Pack(2, tid, seq);
        ok = pair != nullptr && PyList_Append(out[SEQS], pair) == 0;
        Py_XDECREF(pair);
      }
    }
    if (ok) {
      PyObject* row = PyTuple_Pack(18, step_id, tid, cid == Py_None ? pass_id : Py_None, cid, node, role, slot, status,
                                   lay, stored_norm, mn, mx, mean, std_, nan, pinf, ninf, zeros);
      ok = row != nullptr && PyList_Append(out[ROWS], row) == 0;
      Py_XDECREF(row);
    }
    if (ok && (reason != Py_None || csum != Py_None || tlayout != Py_None)) {
      PyObject* note = PyTuple_Pack(6, tid, reason, csum, tlayout, nnz, coalesced);
      ok = note != nullptr && PyList_Append(out[NOTES], note) == 0;
      Py_XDECREF(note);
    }
    if (ok && sharding != Py_None) {
      PyObject* pair = PyTuple_Pack(2, tid, sharding);
      ok = pair != nullptr && PyList_Append(out[SHARDED], pair) == 0;
      Py_XDECREF(pair);
    }
    Py_DECREF(tid);
    ++k;
  }
  Py_DECREF(items);
  PyObject* const targets[5] = {rows, notes, unknown, sharded, seqs};
  PyObject* result = nullptr;
  if (ok && !declined) {
    bool handed = true;
    for (int i = 0; i < 5 && handed; ++i)
      handed = PyList_SetSlice(targets[i], PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, out[i]) == 0;
    result = handed ? PyLong_FromSsize_t(k) : nullptr;
  } else if (ok) {
    result = Py_NewRef(Py_None);
  }
  for (PyObject* o : out) Py_XDECREF(o);
  return result;
}

// ---- the models' structure (gradstore.recording.modules.Structure.same) ------------------------------------------
// same_structure(modules, stored) -> True / False / None: whether the flat fingerprint of `modules` (a list) equals
// `stored` element by element, by identity, as Structure._fingerprint builds it in Python: per module its class, then
// for each of `_modules` and `_parameters` (read with getattr, as torch_private.module_registries does) the dict, its
// keys, its values, in order. None (no judgement) where a module lacks one of the dicts or one is not a dict.
PyObject *s_modules_attr, *s_parameters_attr;

PyObject* py_same_structure(PyObject*, PyObject* args) {
  PyObject *modules, *stored;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &modules, &PyList_Type, &stored)) return nullptr;
  if ((s_modules_attr == nullptr && (s_modules_attr = PyUnicode_InternFromString("_modules")) == nullptr) ||
      (s_parameters_attr == nullptr && (s_parameters_attr = PyUnicode_InternFromString("_parameters")) == nullptr))
    return nullptr;
  Py_ssize_t at = 0, total = PyList_GET_SIZE(stored);
  auto next_is = [&](PyObject* o) {
    if (at >= total || PyList_GET_ITEM(stored, at) != o) return false;
    ++at;
    return true;
  };
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(modules); ++i) {
    PyObject* m = PyList_GET_ITEM(modules, i);
    if (!next_is((PyObject*)Py_TYPE(m))) Py_RETURN_FALSE;
    PyObject* const names[2] = {s_modules_attr, s_parameters_attr};
    for (PyObject* name : names) {
      PyObject* d = PyObject_GetAttr(m, name);
      if (d == nullptr) {
        PyErr_Clear();
        Py_RETURN_NONE;
      }
      if (!PyDict_Check(d)) {
        Py_DECREF(d);
        Py_RETURN_NONE;
      }
      bool same = next_is(d);
      Py_ssize_t n = PyDict_GET_SIZE(d);
      if (same && at + 2 * n > total) same = false;
      Py_ssize_t pos = 0, j = 0;
      PyObject *key, *value;
      while (same && PyDict_Next(d, &pos, &key, &value)) {
        if (PyList_GET_ITEM(stored, at + j) != key || PyList_GET_ITEM(stored, at + n + j) != value) same = false;
        ++j;
      }
      Py_DECREF(d);
      if (!same || j != n) Py_RETURN_FALSE;
      at += 2 * n;
    }
  }
  if (at != total) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

// ---- the module tracker's forward hooks (gradstore.recording.modules.ModuleTracker._pre / _post), common path ------
// module_hooks(tracker, pre, post, is_compiling, thread) -> (pre hook, hook): two callables for
// register_module_forward_pre_hook / register_module_forward_hook that do what the tracker's Python `_pre(module,
// args)` / `_post(module, args, output)` do, appending the same items to the tracker's lists, without a Python frame;
// every case but the common one goes to those Python methods (given), before anything is appended: a module that
// `tracker.names` does not name, known compiled regions (`tracker.regions`, `tracker._region_stack`: pre-hook and
// hook alike), a module call running that the tracker does not note (`tracker._foreign`: the hook), a recomputation
// (`tracker.context`), an output that is a tensor subclass or a container other than a plain tuple, list or dict.
// Like the Python ones, they do nothing on a thread other than `thread` (the tracker's `_thread`: the one that made it)
// or while `is_compiling()` (None: not asked, where the caller asks it first), and return
// None. The sequence counter is read with at::sequence_number::peek (what _get_sequence_nr returns), a grad_fn's
// number and name with Node::sequence_nr / Node::name (what `_sequence_nr()` and `name()` return).
//
// Each hook keeps the tracker's attributes that it reads (`TrackerAttrs`), as last read from the tracker's __dict__
// (borrowed: the dict holds them). Reading them is a dict lookup by interned name each (13 for a pre-hook, 12 for a
// hook: as much as the appends); they change only where an attribute of the tracker is set (`clear()` binds new lists,
// `names` replaced), so they are read again only when the dict changed since: its version tag (PEP 509's
// `ma_version_tag`: each change of any dict takes a new value of one global counter, and a new dict a fresh one)
// differs, or it is another dict. The objects themselves are read at each call (the names' dict, whether `regions` and
// `_region_stack` are empty, whether `context` is None). CPython 3.12 on (where PEP 509 is deprecated and managed
// dicts changed; not tested here): read at each call, as before.
enum { A_NAMES, A_REGIONS, A_CONTEXT, A_REGION_STACK, A_STACK, A_CALL_NAMES, A_ENTRIES, A_CONTEXTS, A_LASTS, A_EXITS,
       A_SEQS, A_OWNERS, A_OWNER_CALLS, A_OUT_CALLS, A_OUT_SEQS, A_OUT_NAMES, A_FOREIGN, A_N };

struct TrackerAttrs {
  PyObject* dict = nullptr;  // the dict they were read from (compared by address with the version); nullptr: none read
  uint64_t version = 0;
  bool pre_ok = false;   // those `tracker_pre` reads there, of the types its common path takes (exact dicts, lists)
  bool post_ok = false;  // those `tracker_post` reads there, exact lists
  PyObject* v[A_N] = {};
};

struct TrackerHook {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  int post;
  unsigned long thread;
  PyObject* tracker;
  PyObject* fallback;
  PyObject* is_compiling;
  TrackerAttrs attrs;
};

PyObject *s_names, *s_regions, *s_context, *s_region_stack, *s_stack, *s_call_names, *s_entries, *s_contexts,
    *s_lasts, *s_exits, *s_seqs, *s_owners, *s_owner_calls, *s_out_calls, *s_out_seqs, *s_out_names, *s_foreign;

bool intern_names() {
  struct {
    PyObject** at;
    const char* text;
  } all[] = {{&s_names, "names"},      {&s_regions, "regions"},   {&s_context, "context"},
             {&s_region_stack, "_region_stack"}, {&s_stack, "_stack"}, {&s_call_names, "_names"},
             {&s_entries, "_entries"},  {&s_contexts, "_contexts"}, {&s_lasts, "_lasts"},
             {&s_exits, "_exits"},      {&s_seqs, "_seqs"},        {&s_owners, "_owners"},
             {&s_owner_calls, "_owner_calls"}, {&s_out_calls, "_out_calls"}, {&s_out_seqs, "_out_seqs"},
             {&s_out_names, "_out_names"}, {&s_foreign, "_foreign"}};
  for (auto& a : all)
    if (*a.at == nullptr && (*a.at = PyUnicode_InternFromString(a.text)) == nullptr) return false;
  return true;
}

#if PY_VERSION_HEX < 0x030C0000
#define GS_DICT_VERSION 1
uint64_t dict_version(PyObject* dict) {
  return ((PyDictObject*)dict)->ma_version_tag;
}
#else
#define GS_DICT_VERSION 0
#endif

// the tracker's attributes (above), read again where its __dict__ changed; false: no usable __dict__ (the Python
// body decides). `pre_ok` / `post_ok` tell whether a common path applies to them.
bool tracker_attrs(TrackerHook* h) {
  TrackerAttrs& a = h->attrs;
  if (h->tracker == nullptr) {  // cleared by the collector
    a.dict = nullptr;
    return false;
  }
  PyObject* dict = PyObject_GenericGetDict(h->tracker, nullptr);
  if (dict == nullptr) {
    PyErr_Clear();
    a.dict = nullptr;
    return false;
  }
  Py_DECREF(dict);  // held by the tracker for the call (read and compared here, never kept past a change)
  if (!PyDict_Check(dict)) {
    a.dict = nullptr;
    return false;
  }
#if GS_DICT_VERSION
  uint64_t version = dict_version(dict);
  if (a.dict == dict && a.version == version && version != 0) return true;
#endif
  PyObject* const names[A_N] = {s_names,     s_regions, s_context, s_region_stack, s_stack,       s_call_names,
                                s_entries,   s_contexts, s_lasts,  s_exits,        s_seqs,        s_owners,
                                s_owner_calls, s_out_calls, s_out_seqs, s_out_names, s_foreign};
  bool there[A_N];
  for (int i = 0; i < A_N; ++i) {
    PyObject* v = PyDict_GetItemWithError(dict, names[i]);  // borrowed; no Python code runs (interned str keys)
    if (v == nullptr) PyErr_Clear();
    a.v[i] = v;
    there[i] = v != nullptr && (i == A_CONTEXT || ((i == A_NAMES || i == A_REGIONS) ? PyDict_CheckExact(v)
                                                                                    : PyList_CheckExact(v)));
  }
  a.pre_ok = there[A_NAMES] && there[A_REGIONS] && there[A_CONTEXT] && there[A_REGION_STACK];
  for (int i : {A_CALL_NAMES, A_ENTRIES, A_CONTEXTS, A_LASTS, A_EXITS, A_STACK, A_SEQS, A_OWNERS, A_OWNER_CALLS})
    a.pre_ok = a.pre_ok && there[i];
  a.post_ok = there[A_REGION_STACK];
  for (int i : {A_STACK, A_CALL_NAMES, A_LASTS, A_EXITS, A_OUT_CALLS, A_OUT_SEQS, A_OUT_NAMES, A_SEQS, A_OWNERS,
                A_OWNER_CALLS, A_FOREIGN})
    a.post_ok = a.post_ok && there[i];
  a.dict = dict;
#if GS_DICT_VERSION
  a.version = version;
#endif
  return true;
}

bool plain_tensor(PyObject* o) {
  PyObject* type = (PyObject*)Py_TYPE(o);
  return type == G.plain[0] || type == G.plain[1];
}

// the plain tensors of a module's output (borrowed: the output holds them for the call), kept inline up to 16
struct OutTensors {
  PyObject* small[16];
  std::vector<PyObject*> more;
  size_t n = 0;
  void push(PyObject* t) {
    if (n < 16) small[n] = t;
    else more.push_back(t);
    ++n;
  }
  PyObject* at(size_t i) const { return i < 16 ? small[i] : more[i - 16]; }
};

// 1: common path, 0: needs the Python body, -1: an error is set. For the post hook: the output's plain tensors
int classify_output(PyObject* output, OutTensors& tensors) {
  if (THPVariable_Check(output)) {
    if (!plain_tensor(output)) return 0;
    tensors.push(output);
    return 1;
  }
  if (PyTuple_Check(output) || PyList_Check(output) || PyDict_Check(output)) {
    if (!PyTuple_CheckExact(output) && !PyList_CheckExact(output) && !PyDict_CheckExact(output)) return 0;
    PyObject* items = PyDict_CheckExact(output) ? PyDict_Values(output) : PySequence_Fast(output, "");
    if (items == nullptr) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    PyObject** at = PySequence_Fast_ITEMS(items);
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok == 1; ++i) {
      if (THPVariable_Check(at[i])) {
        if (!plain_tensor(at[i])) ok = 0;
        else tensors.push(at[i]);  // borrowed: `output` holds it for the call
      } else if (PyTuple_Check(at[i]) || PyList_Check(at[i]) || PyDict_Check(at[i])) {
        ok = 0;  // a container inside (nn.LSTM's (output, (h_n, c_n))): the Python hook reads it
      }
    }
    Py_DECREF(items);
    return ok;
  }
  return 1;
}

PyObject* call_fallback(TrackerHook* h, PyObject* const* args, size_t nargsf) {
  return PyObject_Vectorcall(h->fallback, args, PyVectorcall_NARGS(nargsf), nullptr);
}

// appends; false with an error set
bool append_new(PyObject* list, PyObject* item) {  // steals item
  if (item == nullptr) return false;
  int rc = PyList_Append(list, item);
  Py_DECREF(item);
  return rc == 0;
}

// the name of a grad_fn `fn` as `fn.name()` gives it (a new reference; nullptr with an error set, or an exception
// thrown by Node::name). A C++ Node class's name is its class's (as name_of): one str per class, made at its first
// node and handed out again (only on the thread holding the GIL: no lock); a custom Function's Node is named by its
// Python class, asked each time.
std::unordered_map<std::type_index, PyObject*> g_grad_fn_names;  // nullptr: a custom Function's Node class

PyObject* grad_fn_name(Node* fn) {
  std::type_index type(typeid(*fn));
  auto it = g_grad_fn_names.find(type);
  bool known = it != g_grad_fn_names.end();
  if (known && it->second != nullptr) return Py_NewRef(it->second);
  std::string name = fn->name();  // a custom Function's runs Python code
  bool python = known || is_python_node(fn);
  PyObject* text = PyUnicode_FromStringAndSize(name.data(), (Py_ssize_t)name.size());
  if (text != nullptr && !known) g_grad_fn_names.emplace(type, python ? nullptr : Py_NewRef(text));
  return text;
}

PyObject* tracker_pre(TrackerHook* h, PyObject* const* args, size_t nargsf) {
  PyObject* module = args[0];
  if (!tracker_attrs(h)) return call_fallback(h, args, nargsf);
  const TrackerAttrs& a = h->attrs;
  // names, regions and context decide whether the common path applies; nothing is appended before
  // (`_region_stack` not empty: inside a compiled region, `_pre` keeps its owner)
  if (!a.pre_ok || PyDict_GET_SIZE(a.v[A_REGIONS]) != 0 || a.v[A_CONTEXT] != Py_None ||
      PyList_GET_SIZE(a.v[A_REGION_STACK]) > 0)
    return call_fallback(h, args, nargsf);
  PyObject* key = PyLong_FromVoidPtr(module);
  if (key == nullptr) return nullptr;
  PyObject* name = PyDict_GetItemWithError(a.v[A_NAMES], key);  // borrowed
  Py_DECREF(key);
  if (name == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    return call_fallback(h, args, nargsf);
  }
  // hashing an int key and appending run no Python code: the lists stay the tracker's for the call
  Py_INCREF(name);
  int64_t seq_value = (int64_t)at::sequence_number::peek();
  Py_ssize_t index_value = PyList_GET_SIZE(a.v[A_CALL_NAMES]);
  PyObject* seq = PyLong_FromLongLong(seq_value);  // one object each for the two columns that hold it
  PyObject* index = seq != nullptr ? PyLong_FromSsize_t(index_value) : nullptr;
  bool ok = index != nullptr && PyList_Append(a.v[A_CALL_NAMES], name) == 0 &&
            PyList_Append(a.v[A_ENTRIES], seq) == 0 && PyList_Append(a.v[A_CONTEXTS], Py_None) == 0 &&
            PyList_Append(a.v[A_LASTS], Py_None) == 0 && PyList_Append(a.v[A_EXITS], Py_None) == 0 &&
            PyList_Append(a.v[A_STACK], index) == 0 && PyList_Append(a.v[A_SEQS], seq) == 0 &&
            PyList_Append(a.v[A_OWNERS], name) == 0 && PyList_Append(a.v[A_OWNER_CALLS], index) == 0;
  Py_XDECREF(seq);
  Py_XDECREF(index);
  Py_DECREF(name);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyObject* tracker_post(TrackerHook* h, PyObject* const* args, size_t nargsf) {
  PyObject* output = args[2];
  if (!tracker_attrs(h)) return call_fallback(h, args, nargsf);
  // `_foreign` not empty: a backend's module call runs (`_backend`), whose end `_post` tells apart
  if (!h->attrs.post_ok || PyList_GET_SIZE(h->attrs.v[A_REGION_STACK]) > 0 ||
      PyList_GET_SIZE(h->attrs.v[A_FOREIGN]) > 0)
    return call_fallback(h, args, nargsf);
  OutTensors tensors;
  int kind = classify_output(output, tensors);
  if (kind < 0) return nullptr;
  if (kind == 0) return call_fallback(h, args, nargsf);
  enum { STACK, NAMES, LASTS, EXITS, OUT_CALLS, OUT_SEQS, OUT_NAMES, SEQS, OWNERS, OWNER_CALLS, N };
  const int which[N] = {A_STACK,     A_CALL_NAMES, A_LASTS, A_EXITS,  A_OUT_CALLS,
                        A_OUT_SEQS,  A_OUT_NAMES,  A_SEQS,  A_OWNERS, A_OWNER_CALLS};
  PyObject* l[N];
  for (int i = 0; i < N; ++i) l[i] = Py_NewRef(h->attrs.v[which[i]]);  // ours: a custom Function's name runs Python
  bool ok = true;
  PyObject* seq = PyLong_FromLongLong((int64_t)at::sequence_number::peek());  // the exit and the boundary
  if (seq == nullptr) ok = false;
  Py_ssize_t depth = PyList_GET_SIZE(l[STACK]);
  if (ok && depth > 0) {
    PyObject* top = PyList_GET_ITEM(l[STACK], depth - 1);  // the stack's reference, ours once it is popped
    Py_SET_SIZE(l[STACK], depth - 1);                       // list.pop(): the slot above the size is not read
    Py_ssize_t index = PyLong_AsSsize_t(top);
    if (index < 0 || index >= PyList_GET_SIZE(l[LASTS]) || index >= PyList_GET_SIZE(l[EXITS])) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "module hook: a call index out of range");
      ok = false;
    }
    if (ok) {
      PyObject* last = PyLong_FromSsize_t(PyList_GET_SIZE(l[NAMES]) - 1);
      if (last == nullptr) {
        ok = false;
      } else if (PyList_SetItem(l[LASTS], index, last) < 0) {  // SetItem takes the reference, even failing
        ok = false;
      } else {
        ok = PyList_SetItem(l[EXITS], index, Py_NewRef(seq)) == 0;
      }
    }
    for (size_t k = 0; ok && k < tensors.n; ++k) {
      PyObject* fname = nullptr;
      uint64_t fseq = 0;
      try {  // `.grad_fn` of a view may rebuild its node, and a custom Function's name() runs Python: either may throw
        auto fn = THPVariable_Unpack(tensors.at(k)).grad_fn();  // a copy: the tensor may drop its grad_fn
        if (!fn) continue;
        fname = grad_fn_name(fn.get());
        fseq = fn->sequence_nr();
      } catch (const std::exception& e) {  // a Python error, as `output.grad_fn` raises in the Python hook
        Py_CLEAR(fname);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
        ok = false;
        break;
      }
      if (fname == nullptr) {
        ok = false;
      } else if (PyList_Append(l[OUT_CALLS], top) != 0 ||
                 !append_new(l[OUT_SEQS], PyLong_FromUnsignedLongLong((unsigned long long)fseq))) {
        Py_DECREF(fname);
        ok = false;
      } else {
        ok = append_new(l[OUT_NAMES], fname);
      }
    }
    Py_DECREF(top);
  }
  ok = ok && PyList_Append(l[SEQS], seq) == 0;
  if (ok) {
    Py_ssize_t left = PyList_GET_SIZE(l[STACK]);
    if (left > 0) {
      PyObject* top = PyList_GET_ITEM(l[STACK], left - 1);
      Py_ssize_t index = PyLong_AsSsize_t(top);
      if (index < 0 || index >= PyList_GET_SIZE(l[NAMES])) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "module hook: a call index out of range");
        ok = false;
      } else {
        ok = PyList_Append(l[OWNERS], PyList_GET_ITEM(l[NAMES], index)) == 0 &&
             PyList_Append(l[OWNER_CALLS], top) == 0;
      }
    } else {
      ok = append_new(l[OWNERS], PyUnicode_FromString("")) && append_new(l[OWNER_CALLS], PyLong_FromLong(-1));
    }
  }
  Py_XDECREF(seq);
  for (PyObject* x : l) Py_DECREF(x);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyObject* tracker_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* h = (TrackerHook*)self;
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (h->tracker == nullptr || h->fallback == nullptr) Py_RETURN_NONE;  // cleared by the collector
  if (kwnames != nullptr || n != (h->post ? 3 : 2)) return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
  if (PyThread_get_thread_ident() != h->thread) Py_RETURN_NONE;
  if (h->is_compiling != Py_None) {  // None: the Python function in front asked it already (modules.py's wrappers)
    PyObject* compiling = PyObject_CallNoArgs(h->is_compiling);
    if (compiling == nullptr) return nullptr;
    int yes = PyObject_IsTrue(compiling);
    Py_DECREF(compiling);
    if (yes < 0) return nullptr;
    if (yes) Py_RETURN_NONE;
  }
  return h->post ? tracker_post(h, args, nargsf) : tracker_pre(h, args, nargsf);
}

void tracker_dealloc(PyObject* self) {
  auto* h = (TrackerHook*)self;
  PyObject_GC_UnTrack(self);
  Py_CLEAR(h->tracker);
  Py_CLEAR(h->fallback);
  Py_CLEAR(h->is_compiling);
  PyObject_GC_Del(self);
}

int tracker_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* h = (TrackerHook*)self;
  Py_VISIT(h->tracker);
  Py_VISIT(h->fallback);
  Py_VISIT(h->is_compiling);
  return 0;
}

int tracker_clear(PyObject* self) {
  auto* h = (TrackerHook*)self;
  Py_CLEAR(h->tracker);
  Py_CLEAR(h->fallback);
  Py_CLEAR(h->is_compiling);
  return 0;
}

PyTypeObject TrackerHookType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* py_module_hooks(PyObject*, PyObject* args) {
  PyObject *tracker, *pre, *post, *is_compiling;
  unsigned long thread;
  if (!PyArg_ParseTuple(args, "OOOOk", &tracker, &pre, &post, &is_compiling, &thread)) return nullptr;
  if (!G.ready) {
    PyErr_SetString(PyExc_RuntimeError, "module_hooks(): init() first");
    return nullptr;
  }
  if (!intern_names()) return nullptr;
  PyObject* out = PyTuple_New(2);
  if (out == nullptr) return nullptr;
  for (int post_hook = 0; post_hook < 2; ++post_hook) {
    auto* h = PyObject_GC_New(TrackerHook, &TrackerHookType);
    if (h == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    h->vectorcall = tracker_call;
    h->post = post_hook;
    h->thread = thread;
    h->tracker = Py_NewRef(tracker);
    h->fallback = Py_NewRef(post_hook ? post : pre);
    h->is_compiling = Py_NewRef(is_compiling);
    new (&h->attrs) TrackerAttrs();  // none read yet
    PyObject_GC_Track((PyObject*)h);
    PyTuple_SET_ITEM(out, post_hook, (PyObject*)h);
  }
  return out;
}

bool ready_tracker_type() {
  TrackerHookType.tp_name = "_gradstore_hooks.ModuleHook";
  TrackerHookType.tp_basicsize = sizeof(TrackerHook);
  TrackerHookType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  TrackerHookType.tp_vectorcall_offset = offsetof(TrackerHook, vectorcall);
  TrackerHookType.tp_call = PyVectorcall_Call;
  TrackerHookType.tp_dealloc = tracker_dealloc;
  TrackerHookType.tp_traverse = tracker_traverse;
  TrackerHookType.tp_clear = tracker_clear;
  TrackerHookType.tp_doc = "gradstore's module tracker hook (module_hooks)";
  return PyType_Ready(&TrackerHookType) == 0;
}

// ---- the module tracker's tap: nn.Module._compiled_call_impl (gradstore.recording.modules) ---------------------------
// module_tap(tracer_get) -> the process's ModuleTap, made once: an object that gradstore.recording.modules sets as the
// class attribute `nn.Module._compiled_call_impl` (torch's is None) while a ModuleTracker records. torch's
// `nn.Module.__call__` (`_wrapped_call_impl`) reads `self._compiled_call_impl` first and, when it is not None, calls
// it in place of `self._call_impl`; an instance attribute of that name (`Module.compile()`) is found before a class
// attribute without `__set__`, as here. The tap is a non-data descriptor. Read by `_wrapped_call_impl` (the code
// object given to tap_target: the frame reading it is checked) from a module on the tracker's thread, while a target
// is set, no tracer runs (torch.compiler's `_is_compiling_flag`, what `torch.compiler.is_compiling()` returns: set
// while dynamo compiles and while torch.export traces) and no module call has handed the thread to global hooks
// (`tap_passthrough`), it gives a BoundTap (below), which notes the call around `module._call_impl(*args,
// **kwargs)`. Read anywhere else (user code asking `module._compiled_call_impl`, the class), it gives torch's None.
// No Python frame and no global module hook: torch's `_call_impl` takes its path without hooks.
// `tracer_get`: a Python function `__get__(self, module, owner=None)` that returns None, put in the type's dict under
// `__get__` (the C slot, which the interpreter calls, is left as it is): torch._dynamo traces a descriptor's
// `__get__` only where the type's dict holds a Python function, and a compiled region notes nothing (as the
// tracker's global hooks, which ask `torch.compiler.is_compiling()`, return at once there).
//
// tap_target(tap, pre, post, hooked, thread, global_dicts, flags, wrapped_code) sets the target: `pre` / `post` are
// module_hooks' callables (called `pre(module, ())` before and `post(module, (), output)` after `_call_impl`: they
// read no argument but the module and the output), `hooked(module, args, kwargs)` takes a call where something
// runs between a global hook and the forward (the module's own forward pre-hooks, forward hooks or backward hooks,
// or a global module hook in `global_dicts`, torch.nn.modules.module's dicts), `thread` the tracker's, `flags` the
// dict holding `_is_compiling_flag` (torch.compiler's globals), `wrapped_code` the code object of torch's
// `_wrapped_call_impl`. tap_target(tap) clears it. tap_passthrough(tap, on): while on, the tap gives None (a call
// that `hooked` runs with global hooks, and the calls inside it).
struct ModuleTap {
  PyObject_HEAD
  unsigned long thread;
  int passthrough;
  PyObject* pre;  // nullptr: no target
  PyObject* post;
  PyObject* hooked;
  PyObject* global_dicts;  // a tuple of dicts
  PyObject* flags;         // a dict
  PyObject* wrapped_code;  // a code object
};

struct BoundTap {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  ModuleTap* tap;
  PyObject* module;
};

PyObject *s_forward_hooks, *s_forward_pre_hooks, *s_backward_hooks, *s_backward_pre_hooks, *s_call_impl,
    *s_compiling_flag, *s_empty;
PyTypeObject ModuleTapType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject BoundTapType = {PyVarObject_HEAD_INIT(nullptr, 0)};
ModuleTap* the_tap = nullptr;

// 1 where a global module hook or one of the module's own forward / backward hooks is registered, 0 where none is
int tap_has_hooks(ModuleTap* t, PyObject* module) {
  Py_ssize_t n = PyTuple_GET_SIZE(t->global_dicts);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* d = PyTuple_GET_ITEM(t->global_dicts, i);
    if (PyDict_Check(d) && PyDict_GET_SIZE(d) > 0) return 1;
  }
  PyObject* dict = PyObject_GenericGetDict(module, nullptr);
  if (dict == nullptr) {
    PyErr_Clear();
    return 1;  // no instance dict to read: `hooked` decides
  }
  int found = 0;
  PyObject* const names[4] = {s_forward_pre_hooks, s_forward_hooks, s_backward_hooks, s_backward_pre_hooks};
  for (PyObject* name : names) {
    PyObject* v = PyDict_Check(dict) ? PyDict_GetItemWithError(dict, name) : nullptr;
    if (v == nullptr) PyErr_Clear();
    if (v != nullptr && (!PyDict_Check(v) || PyDict_GET_SIZE(v) > 0)) {
      found = 1;
      break;
    }
  }
  Py_DECREF(dict);
  return found;
}

PyObject* bound_tap_call(PyObject* self, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  auto* b = (BoundTap*)self;
  ModuleTap* t = b->tap;
  PyObject* module = b->module;
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  Py_ssize_t nkw = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  // module, then the call's arguments: what `_call_impl` is called with (a method call, `module` as self)
  PyObject* small[10];
  std::vector<PyObject*> big;
  PyObject** stack = small;
  if (n + nkw + 1 > 10) {
    big.resize((size_t)(n + nkw + 1));
    stack = big.data();
  }
  stack[0] = module;
  for (Py_ssize_t i = 0; i < n + nkw; ++i) stack[i + 1] = argv[i];
  if (t->pre == nullptr || t->passthrough || PyThread_get_thread_ident() != t->thread)  // changed since it was bound
    return PyObject_VectorcallMethod(s_call_impl, stack, (size_t)(n + 1), kwnames);
  Py_INCREF(t);  // the target's objects are held for the call: a step may end inside it
  PyObject* pre = Py_NewRef(t->pre);
  PyObject* post = Py_NewRef(t->post);
  PyObject* out = nullptr;
  if (tap_has_hooks(t, module)) {
    PyObject* args = PyTuple_New(n);
    PyObject* kwargs = args != nullptr ? PyDict_New() : nullptr;
    if (kwargs != nullptr) {
      for (Py_ssize_t i = 0; i < n; ++i) PyTuple_SET_ITEM(args, i, Py_NewRef(argv[i]));
      bool ok = true;
      for (Py_ssize_t i = 0; i < nkw && ok; ++i)
        ok = PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), argv[n + i]) == 0;
      if (ok) {
        PyObject* hooked_args[3] = {module, args, kwargs};
        out = PyObject_Vectorcall(t->hooked, hooked_args, 3, nullptr);
      }
    }
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
  } else {
    PyObject* pre_args[2] = {module, s_empty};
    PyObject* r = PyObject_Vectorcall(pre, pre_args, 2, nullptr);
    if (r != nullptr) {
      Py_DECREF(r);
      out = PyObject_VectorcallMethod(s_call_impl, stack, (size_t)(n + 1), kwnames);
      if (out != nullptr) {
        PyObject* post_args[3] = {module, s_empty, out};
        r = PyObject_Vectorcall(post, post_args, 3, nullptr);
        if (r == nullptr) Py_CLEAR(out);
        Py_XDECREF(r);
      } else if (PyErr_ExceptionMatches(PyExc_Exception)) {
        // as torch runs a global hook registered with always_call=True when the forward raised an Exception (not
        // a KeyboardInterrupt): with the output None; an error of the hook is dropped, the forward's propagates
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject* post_args[3] = {module, s_empty, Py_None};
        r = PyObject_Vectorcall(post, post_args, 3, nullptr);
        if (r == nullptr) PyErr_Clear();
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb);
      }
    }
  }
  Py_DECREF(pre);
  Py_DECREF(post);
  Py_DECREF(t);
  return out;
}

// torch's call path reads the tap twice a module call (`if self._compiled_call_impl is not None: return
// self._compiled_call_impl(...)`): the first BoundTap is gone before the second is made, and its memory is kept here
// for it (one slot; only with the GIL held) in place of a free and a malloc each time
BoundTap* g_spare_bound_tap = nullptr;

void bound_tap_dealloc(PyObject* self) {
  auto* b = (BoundTap*)self;
  Py_CLEAR(b->tap);
  Py_CLEAR(b->module);
  if (g_spare_bound_tap == nullptr) g_spare_bound_tap = b;
  else PyObject_Free(self);
}

// 1 when the frame reading the attribute runs `wrapped_code` (torch's `_wrapped_call_impl`), 0 otherwise
int read_by_call_path(ModuleTap* t) {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the frame whose attribute read called the descriptor
  if (frame == nullptr) return 0;
  PyCodeObject* code = PyFrame_GetCode(frame);
  int yes = (PyObject*)code == t->wrapped_code;
  Py_DECREF(code);
  return yes;
}

PyObject* module_tap_get(PyObject* self, PyObject* obj, PyObject*) {
  auto* t = (ModuleTap*)self;
  if (obj == nullptr || obj == Py_None || t->pre == nullptr || t->passthrough ||
      PyThread_get_thread_ident() != t->thread)
    Py_RETURN_NONE;
  PyObject* compiling = PyDict_GetItemWithError(t->flags, s_compiling_flag);  // borrowed
  if (compiling == nullptr && PyErr_Occurred()) return nullptr;
  if (compiling != nullptr && compiling != Py_False) Py_RETURN_NONE;
  if (!read_by_call_path(t)) Py_RETURN_NONE;
  BoundTap* b = g_spare_bound_tap;
  if (b != nullptr) {
    g_spare_bound_tap = nullptr;
    PyObject_Init((PyObject*)b, &BoundTapType);  // its type, one reference
  } else if ((b = PyObject_New(BoundTap, &BoundTapType)) == nullptr) {
    return nullptr;
  }
  b->vectorcall = bound_tap_call;
  b->tap = (ModuleTap*)Py_NewRef(self);
  b->module = Py_NewRef(obj);
  return (PyObject*)b;
}

void module_tap_clear_target(ModuleTap* t) {
  Py_CLEAR(t->pre);
  Py_CLEAR(t->post);
  Py_CLEAR(t->hooked);
  Py_CLEAR(t->global_dicts);
  Py_CLEAR(t->flags);
  Py_CLEAR(t->wrapped_code);
  t->passthrough = 0;
}

int module_tap_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* t = (ModuleTap*)self;
  Py_VISIT(t->pre);
  Py_VISIT(t->post);
  Py_VISIT(t->hooked);
  Py_VISIT(t->global_dicts);
  Py_VISIT(t->flags);
  Py_VISIT(t->wrapped_code);
  return 0;
}

int module_tap_clear(PyObject* self) {
  module_tap_clear_target((ModuleTap*)self);
  return 0;
}

void module_tap_dealloc(PyObject* self) {  // the process's tap is held by this module: reached only at teardown
  PyObject_GC_UnTrack(self);
  module_tap_clear_target((ModuleTap*)self);
  PyObject_GC_Del(self);
}

PyObject* py_module_tap(PyObject*, PyObject* args) {
  PyObject* tracer_get;
  if (!PyArg_ParseTuple(args, "O", &tracer_get)) return nullptr;
  if (the_tap != nullptr) return Py_NewRef((PyObject*)the_tap);
  if (!PyFunction_Check(tracer_get)) {
    PyErr_SetString(PyExc_TypeError, "module_tap(tracer_get): a Python function");
    return nullptr;
  }
  struct {
    PyObject** at;
    const char* text;
  } all[] = {{&s_forward_hooks, "_forward_hooks"},
             {&s_forward_pre_hooks, "_forward_pre_hooks"},
             {&s_backward_hooks, "_backward_hooks"},
             {&s_backward_pre_hooks, "_backward_pre_hooks"},
             {&s_call_impl, "_call_impl"},
             {&s_compiling_flag, "_is_compiling_flag"}};
  for (auto& a : all)
    if (*a.at == nullptr && (*a.at = PyUnicode_InternFromString(a.text)) == nullptr) return nullptr;
  if (s_empty == nullptr && (s_empty = PyTuple_New(0)) == nullptr) return nullptr;
  // the slot stays ours; the dict's `__get__` is what a tracer reads (inspect.getattr_static(type(tap), "__get__"))
  if (PyDict_SetItemString(ModuleTapType.tp_dict, "__get__", tracer_get) < 0) return nullptr;
  PyType_Modified(&ModuleTapType);
  auto* t = PyObject_GC_New(ModuleTap, &ModuleTapType);
  if (t == nullptr) return nullptr;
  t->thread = 0;
  t->passthrough = 0;
  t->pre = t->post = t->hooked = t->global_dicts = t->flags = t->wrapped_code = nullptr;
  PyObject_GC_Track((PyObject*)t);
  the_tap = t;
  return Py_NewRef((PyObject*)t);
}

PyObject* py_tap_target(PyObject*, PyObject* args) {
  PyObject *tap, *pre = nullptr, *post = nullptr, *hooked = nullptr, *global_dicts = nullptr, *flags = nullptr,
                 *wrapped_code = nullptr;
  unsigned long thread = 0;
  if (!PyArg_ParseTuple(args, "O!|OOOkO!O!O!", &ModuleTapType, &tap, &pre, &post, &hooked, &thread, &PyTuple_Type,
                        &global_dicts, &PyDict_Type, &flags, &PyCode_Type, &wrapped_code))
    return nullptr;
  auto* t = (ModuleTap*)tap;
  if (pre == nullptr) {
    module_tap_clear_target(t);
    Py_RETURN_NONE;
  }
  if (wrapped_code == nullptr) {
    PyErr_SetString(PyExc_TypeError,
                    "tap_target(tap, pre, post, hooked, thread, global_dicts, flags, wrapped_code) or tap_target(tap)");
    return nullptr;
  }
  module_tap_clear_target(t);
  t->pre = Py_NewRef(pre);
  t->post = Py_NewRef(post);
  t->hooked = Py_NewRef(hooked);
  t->global_dicts = Py_NewRef(global_dicts);
  t->flags = Py_NewRef(flags);
  t->wrapped_code = Py_NewRef(wrapped_code);
  t->thread = thread;
  Py_RETURN_NONE;
}

PyObject* py_tap_passthrough(PyObject*, PyObject* args) {
  PyObject* tap;
  int on;
  if (!PyArg_ParseTuple(args, "O!p", &ModuleTapType, &tap, &on)) return nullptr;
  ((ModuleTap*)tap)->passthrough = on;
  Py_RETURN_NONE;
}

bool ready_tap_types() {
  ModuleTapType.tp_name = "_gradstore_hooks.ModuleTap";
  ModuleTapType.tp_basicsize = sizeof(ModuleTap);
  ModuleTapType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  ModuleTapType.tp_descr_get = module_tap_get;
  ModuleTapType.tp_dealloc = module_tap_dealloc;
  ModuleTapType.tp_traverse = module_tap_traverse;
  ModuleTapType.tp_clear = module_tap_clear;
  ModuleTapType.tp_doc = "nn.Module._compiled_call_impl while gradstore's module tracker records (module_tap)";
  BoundTapType.tp_name = "_gradstore_hooks.BoundTap";
  BoundTapType.tp_basicsize = sizeof(BoundTap);
  BoundTapType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  BoundTapType.tp_vectorcall_offset = offsetof(BoundTap, vectorcall);
  BoundTapType.tp_call = PyVectorcall_Call;
  BoundTapType.tp_dealloc = bound_tap_dealloc;
  BoundTapType.tp_doc = "one module call with gradstore's module tracker around it (module_tap)";
  return PyType_Ready(&ModuleTapType) == 0 && PyType_Ready(&BoundTapType) == 0;
}

// none_values(rows, keep_order, multi_rows, max_bound) -> [(pattern, flat, rest)]: the rows (a list of tuples) split by
// where they hold None, as gradstore.store.inserts.Insert.run splits them for its statements, with the values each
// group's statements bind already picked: pattern () for a row without None, else a tuple of bools (True where the
// row holds None), one per item. keep_order: runs of consecutive rows with the same pattern, in order; else one group
// per pattern, in order of first appearance, each in the rows' order. A group's bound values are its rows' values
// that are not None (a row of None only binds its first item, None: a statement needs a parameter), `width` a row;
// with per = min(multi_rows, max_bound / width) rows to a statement, `flat` holds the bound values of the group's
// first rows, a whole number of statements of `per` rows (none where per < 2), one list in row order, and `rest`
// the bound values of the others, a tuple a row. Raises TypeError for a row that is not a tuple (the caller then
// splits them itself).
namespace {
struct ValueGroup {
  PyObject* pattern = nullptr;  // owned until handed to the result
  std::vector<PyObject*> rows;  // borrowed from the caller's list
  Py_ssize_t width = 0;
};

PyObject* group_values(ValueGroup& g, Py_ssize_t multi_rows, Py_ssize_t max_bound) {
  const Py_ssize_t n = (Py_ssize_t)g.rows.size();
  const Py_ssize_t width = g.width > 0 ? g.width : 1;
  Py_ssize_t per = std::min(multi_rows, max_bound / width);
  const Py_ssize_t whole = per > 1 ? n - n % per : 0;
  PyObject* flat = PyList_New(whole * width);
  PyObject* rest = PyList_New(n - whole);
  if (flat == nullptr || rest == nullptr) {
    Py_XDECREF(flat);
    Py_XDECREF(rest);
    return nullptr;
  }
  Py_ssize_t at = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* row = g.rows[(size_t)i];
    const Py_ssize_t m = PyTuple_GET_SIZE(row);
    PyObject* picked = nullptr;
    if (i >= whole) {
      picked = PyTuple_New(width);
      if (picked == nullptr) {
        Py_DECREF(flat);
        Py_DECREF(rest);
        return nullptr;
      }
      PyList_SET_ITEM(rest, i - whole, picked);
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < m && k < width; ++j) {
      PyObject* v = PyTuple_GET_ITEM(row, j);
      if (v == Py_None && !(g.width == 0 && j == 0)) continue;
      Py_INCREF(v);
      if (picked != nullptr) {
        PyTuple_SET_ITEM(picked, k, v);
      } else {
        PyList_SET_ITEM(flat, at++, v);
      }
      ++k;
    }
  }
  PyObject* out = PyTuple_New(3);
  if (out == nullptr) {
    Py_DECREF(flat);
    Py_DECREF(rest);
    return nullptr;
  }
  PyTuple_SET_ITEM(out, 0, g.pattern);
  g.pattern = nullptr;
  PyTuple_SET_ITEM(out, 1, flat);
  PyTuple_SET_ITEM(out, 2, rest);
  return out;
}
}  // namespace

PyObject* py_none_values(PyObject*, PyObject* args) {
  PyObject* rows;
  int keep_order;
  Py_ssize_t multi_rows, max_bound;
  if (!PyArg_ParseTuple(args, "O!pnn", &PyList_Type, &rows, &keep_order, &multi_rows, &max_bound)) return nullptr;
  std::vector<ValueGroup> groups;
  std::unordered_map<std::string, size_t> index;  // pattern -> its group (not keep_order)
  std::string key, last;
  auto fail = [&groups]() -> PyObject* {
    for (auto& g : groups) Py_XDECREF(g.pattern);
    return nullptr;
  };
  const Py_ssize_t n = PyList_GET_SIZE(rows);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* row = PyList_GET_ITEM(rows, i);
    if (!PyTuple_Check(row)) {
      PyErr_SetString(PyExc_TypeError, "none_values(): a row that is not a tuple");
      return fail();
    }
    const Py_ssize_t m = PyTuple_GET_SIZE(row);
    key.assign((size_t)m, '\0');
    Py_ssize_t nones = 0;
    for (Py_ssize_t j = 0; j < m; ++j) {
      if (PyTuple_GET_ITEM(row, j) == Py_None) {
        key[(size_t)j] = '\1';
        ++nones;
      }
    }
    if (m == 0) {
      PyErr_SetString(PyExc_TypeError, "none_values(): a row of no values");
      return fail();
    }
    const bool any = nones > 0;  // the key keeps the row's length: rows of two lengths never share a group
    ValueGroup* target = nullptr;
    if (keep_order) {
      if (!groups.empty() && key == last) target = &groups.back();
    } else {
      auto hit = index.find(key);
      if (hit != index.end()) target = &groups[hit->second];
    }
    if (target == nullptr) {
      PyObject* pattern = PyTuple_New(any ? m : 0);
      if (pattern == nullptr) return fail();
      for (Py_ssize_t j = 0; any && j < m; ++j) {
        PyObject* flag = key[(size_t)j] ? Py_True : Py_False;
        Py_INCREF(flag);
        PyTuple_SET_ITEM(pattern, j, flag);
      }
      groups.emplace_back();
      groups.back().pattern = pattern;
      groups.back().width = m - nones;
      if (keep_order) {
        last = key;
      } else {
        index.emplace(key, groups.size() - 1);
      }
      target = &groups.back();
    }
    target->rows.push_back(row);
  }
  PyObject* out = PyList_New((Py_ssize_t)groups.size());
  if (out == nullptr) return fail();
  for (size_t g = 0; g < groups.size(); ++g) {
    PyObject* item = group_values(groups[g], multi_rows, max_bound);
    if (item == nullptr) {
      Py_DECREF(out);
      for (size_t h = g; h < groups.size(); ++h) Py_XDECREF(groups[h].pattern);
      return nullptr;
    }
    PyList_SET_ITEM(out, (Py_ssize_t)g, item);
  }
  return out;
}

// grads_of(params, types) -> (flags, grads) or None: each parameter's `requires_grad` (a list of bools) and `.grad` (a
// list: the tensor, or None), read from the C++ tensor as Python's `p.requires_grad` and `p.grad` read them, without
// an attribute lookup each (292 parameters: about 85 us in Python). None, to have the caller read them in Python,
// where an item is not a leaf tensor of one of `types` exactly (a tuple of types: torch.Tensor and
// torch.nn.Parameter; a subclass may override those attributes, or handle them in __torch_function__; a non-leaf's
// `.grad` warns in Python) or reading one throws. With the GIL held.
PyObject* py_grads_of(PyObject*, PyObject* args) {
  PyObject *params, *types;
  if (!PyArg_ParseTuple(args, "OO!", &params, &PyTuple_Type, &types)) return nullptr;
  PyObject* seq = PySequence_Fast(params, "grads_of(params, types): a sequence of tensors");
  if (seq == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  PyObject* flags = PyList_New(n);
  PyObject* grads = PyList_New(n);
  if (flags == nullptr || grads == nullptr) {
    Py_XDECREF(flags);
    Py_XDECREF(grads);
    Py_DECREF(seq);
    return nullptr;
  }
  bool ok = true;
  try {
    for (Py_ssize_t i = 0; i < n && ok; ++i) {
      PyObject* item = items[i];
      bool known = false;
      for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(types); ++k) known = known || (PyObject*)Py_TYPE(item) == PyTuple_GET_ITEM(types, k);
      if (!known || !THPVariable_Check(item)) {
        ok = false;
        break;
      }
      const at::Tensor& v = THPVariable_Unpack(item);
      if (!v.is_leaf()) {
        ok = false;
        break;
      }
      PyObject* flag = v.requires_grad() ? Py_True : Py_False;
      Py_INCREF(flag);
      PyList_SET_ITEM(flags, i, flag);
      const at::Tensor& g = v.grad();
      PyObject* grad = g.defined() ? THPVariable_Wrap(g) : none();
      if (grad == nullptr) {
        ok = false;
        PyErr_Clear();
        break;
      }
      PyList_SET_ITEM(grads, i, grad);
    }
  } catch (const std::exception&) {
    ok = false;
  }
  Py_DECREF(seq);
  if (!ok) {  // the unset items of a list are NULL, which its deallocation skips
    Py_DECREF(flags);
    Py_DECREF(grads);
    Py_RETURN_NONE;
  }
  return Py_BuildValue("(NN)", flags, grads);
}

PyObject* py_abi(PyObject*, PyObject*) { return PyLong_FromLong(ABI); }

PyMethodDef methods[] = {
    {"abi", py_abi, METH_NOARGS, "The ABI version of this build."},
    {"grads_of", py_grads_of, METH_VARARGS, "The parameters' requires_grad flags and .grad, read here."},
    {"init", py_init, METH_VARARGS, "Set the kernel entry points, dtype codes and the Python fallback."},
    {"scalar_type", py_scalar_type, METH_O, "c10::ScalarType of a tensor, as an int."},
    {"step", py_step, METH_NOARGS, "A new step: the call counter and the active passes."},
    {"next_seq", py_next_seq, METH_O, "The step's next call number."},
    {"open_top", py_open_top, METH_O, "(pass number, seq) of this thread's innermost open call, or None."},
    {"walk", py_walk, METH_VARARGS, "The graph walk from the roots: nodes, edges, seqs, signature, leaves."},
    {"walk_node", py_walk_node, METH_VARARGS, "The Python object of a lazy walk's i-th Node."},
    {"node_address", py_node_address, METH_O, "The address of the C++ Node behind a Node's Python object."},
    {"install", py_install, METH_VARARGS, "Hook every wanted node of a pass."},
    {"finish", py_finish, METH_O, "Remove the pass's hooks; its calls and fallbacks."},
    {"rows", py_rows, METH_VARARGS, "The pass's tensor rows."},
    {"call_rows", py_call_rows, METH_VARARGS, "The pass's call rows."},
    {"pack", py_pack, METH_O, "The pass's tensor and call rows, packed as bytes."},
    {"unpack_rows", py_unpack_rows, METH_VARARGS, "Tensor rows from pack()'s bytes."},
    {"unpack_calls", py_unpack_calls, METH_VARARGS, "Call rows from pack()'s bytes."},
    {"grad_states", py_grad_states, METH_O, "What tells each parameter's .grad changed, as bytes."},
    {"ops_watch", py_ops_watch, METH_O, "Add (True) or remove (False) an operator watcher; the operators counted so far."},
    {"grad_impls", py_grad_impls, METH_O, "The address of each parameter's .grad TensorImpl, as bytes."},
    {"param_rows", py_param_rows, METH_VARARGS, "The rows of the parameters' .grad measured here, or None each."},
    {"param_pack", py_param_pack, METH_VARARGS, "The parameters' .grad measured here, as packed tensor rows."},
    {"module_hooks", py_module_hooks, METH_VARARGS, "The module tracker's forward pre-hook and hook, in C."},
    {"module_tap", py_module_tap, METH_VARARGS, "The process's nn.Module._compiled_call_impl tap (made once)."},
    {"tap_target", py_tap_target, METH_VARARGS, "Set (or clear) the module tap's target: the tracker's hooks."},
    {"tap_passthrough", py_tap_passthrough, METH_VARARGS, "While on, the module tap gives torch's None."},
    {"tensor_rows", py_tensor_rows, METH_VARARGS, "The writer's tensor_data rows of one source of tensor rows."},
    {"same_structure", py_same_structure, METH_VARARGS, "Whether the modules' fingerprint is the one stored."},
    {"none_values", py_none_values, METH_VARARGS, "Rows split by where they hold None, their bound values picked."},
    {nullptr, nullptr, 0, nullptr}};

struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gradstore_hooks", "gradstore's node hooks in C++", -1,
                             methods};

}  // namespace

PyMODINIT_FUNC PyInit__gradstore_hooks(void) {
  if (!ready_tracker_type() || !ready_tap_types()) return nullptr;
  return PyModule_Create(&module);
}

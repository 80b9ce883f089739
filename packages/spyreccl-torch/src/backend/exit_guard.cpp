// exit_guard.cpp — see exit_guard.h.
#include "backend/exit_guard.h"

#include <ATen/core/ivalue.h>
#include <unistd.h>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/progress_thread.h"

namespace py = pybind11;

namespace spyreccl_torch {
namespace {

struct ExitState {
  std::mutex mutex;
  std::condition_variable idle;
  // With the process that registered each: a child forked after a group was made inherits
  // the list but not the threads, which it must not try to stop (join) at its own exit.
  std::vector<std::pair<pid_t, std::weak_ptr<ProgressThread>>> threads;
  bool closed = false;  // prepareForExit() ran: no guarded callback may take the GIL
  int running = 0;      // guarded callbacks between enter() and leave()
};

// Leaked on purpose: the state must outlive every thread that may still complete a Work
// while static destructors run.
ExitState& state() {
  static auto* instance = new ExitState();
  return *instance;
}

// A guarded callback may take the GIL only between enter() (true) and leave().
bool enter() {
  ExitState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.closed) {
    return false;
  }
  ++s.running;
  return true;
}

void leave() {
  ExitState& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    --s.running;
  }
  s.idle.notify_all();
}

// The Python callable of a guarded callback. Its reference is dropped with the GIL held, or
// never (after prepareForExit, or when the interpreter is gone).
class PyCallable {
 public:
  explicit PyCallable(py::object fn) : fn_(fn.release().ptr()) {}
  PyCallable(const PyCallable&) = delete;
  PyCallable& operator=(const PyCallable&) = delete;

  ~PyCallable() {
    if (fn_ != nullptr && enter()) {
      {
        py::gil_scoped_acquire gil;
        Py_DECREF(fn_);
      }
      leave();
    }
  }

  void call(const c10::ivalue::Future& future) {
    if (!enter()) {
      return;
    }
    {
      py::gil_scoped_acquire gil;
      PyObject* fn = fn_;
      fn_ = nullptr;  // called once; dropped below, under the GIL
      try {
        py::object error = py::none();
        if (future.hasError()) {
          error = py::str(future.tryRetrieveErrorMessage());
        }
        const py::handle callee(fn);  // (not `py::handle(fn)(error);`: that declares a variable)
        callee(error);
      } catch (py::error_already_set& e) {
        // Like an exception in a thread: reported, never propagated into the completing
        // thread (a gloo worker or our progress thread).
        e.discard_as_unraisable("spyreccl guarded Work callback");
      } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        PyErr_WriteUnraisable(fn);
      }
      Py_DECREF(fn);
    }
    leave();
  }

 private:
  PyObject* fn_;
};

}  // namespace

void registerProgressThread(const std::shared_ptr<ProgressThread>& thread) {
  ExitState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  // Forget the threads that are gone, so that a job creating many groups keeps a short list.
  const pid_t self = getpid();
  std::vector<std::pair<pid_t, std::weak_ptr<ProgressThread>>> live;
  live.reserve(s.threads.size() + 1);
  for (auto& entry : s.threads) {
    if (entry.first == self && !entry.second.expired()) {
      live.push_back(std::move(entry));
    }
  }
  live.emplace_back(self, thread);
  s.threads = std::move(live);
}

void prepareForExit() {
  py::gil_scoped_release release;
  ExitState& s = state();
  std::vector<std::shared_ptr<ProgressThread>> threads;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.closed) {
      return;
    }
    const pid_t self = getpid();
    for (auto& [pid, weak] : s.threads) {
      if (pid != self) {
        continue;  // inherited through fork(): the thread is not in this process
      }
      if (auto thread = weak.lock()) {
        threads.push_back(std::move(thread));
      }
    }
    s.threads.clear();
  }
  for (auto& thread : threads) {
    // Not under the mutex: a callback of a job it drains may create a group, which
    // registers its thread.
    thread->stop(/*drain=*/true);
  }
  threads.clear();
  std::unique_lock<std::mutex> lock(s.mutex);
  s.closed = true;
  s.idle.wait(lock, [&s] { return s.running == 0; });
}

void addGuardedCallback(c10d::Work& work, py::object fn) {
  auto callable = std::make_shared<PyCallable>(std::move(fn));
  c10::intrusive_ptr<c10::ivalue::Future> future = work.getFuture();
  // A future that already completed runs the callback here, on the caller's thread (which
  // holds the GIL: taking it again is allowed).
  future->addCallback([callable](c10::ivalue::Future& done) { callable->call(done); },
                      /*uses_future=*/false);
}

}  // namespace spyreccl_torch

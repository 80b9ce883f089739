// process_group_spyreccl.hpp — the c10d backend "spyreccl" for the spyre device.
//
// Modelled on ProcessGroupGloo: every operation is validated on the calling thread, turned
// into a list of core calls ("steps") and queued on the group's progress thread, which runs
// them in issue order against the group's spyreccl communicator and completes the returned
// WorkSpyreccl. Small collectives (synchronous ones, and small functional collectives)
// issued while the progress thread is idle run on the calling thread instead (the inline fast path,
// see submit()): same Work, same errors, without the hand-off between threads; small sends and
// receives are likewise posted (non-blocking) on the calling thread, and only handed to the
// progress thread when the core cannot complete them at once. The communicator is created at
// construction (rank 0 publishes a spyrecclUniqueId in the c10d Store) or by spyrecclCommSplit from
// a parent group.
//
// Only the spyreccl C API (spyreccl.h) is used; tensors reach it exclusively through
// tensor_translation.h.
//
// Threading: like every c10d backend, the public methods expect to be called from one
// thread at a time per group, in the same order on all ranks.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <spyreccl/spyreccl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/flight_recorder.h"
#include "backend/progress_thread.h"
#include "backend/tensor_translation.h"
#include "backend/torch_compat.h"

namespace spyreccl_torch {

class Communicator;
class WorkSpyreccl;

constexpr const char* kBackendName = "spyreccl";

// Synchronous collectives (async_op=False) whose payload is at most this many bytes run on
// the calling thread when nothing is queued on the group's progress thread; the
// environment variable overrides it (read when a group is created; 0 disables). The caller
// waits for them anyway, so the bound is only there to keep other threads that submit to
// the same group from waiting long behind one call: 4 MiB takes about 1 ms, while the
// hand-off it saves costs 20-80 us (docs/performance.md, "Per-call cost").
constexpr const char* kInlineMaxBytesEnv = "SPYRECCL_INLINE_MAX_BYTES";
constexpr size_t kDefaultInlineMaxBytes = size_t{4} << 20;
// Functional collectives (`_c10d_functional`, what DTensor, FSDP2 and compiled graphs call)
// of at most this many bytes run on the calling thread too, under the same conditions. They
// are asynchronous calls whose callers may place computation before their wait_tensor, so
// the default bound is about the size whose transfer takes as long as the hand-off to the
// progress thread that running inline saves: 1 MiB, where the hand-off costs 30-70 us
// against ~95 us for the transfer inline (docs/notes/tp-decode.md). It covers every
// all_reduce of a tensor-parallel decode step (batch x width, at most 32 x 8192 float32),
// which eager DTensor issues asynchronously and waits for at the next use; larger ones keep
// overlapping with the caller's computation.
// dist.*(async_op=True) never runs inline: its Work may be waited on with a timeout of its
// own or polled, which a call that blocked until its peers arrived would defeat; its wait()
// runs the operation itself when the progress thread has not started it yet.
constexpr const char* kInlineFunctionalMaxBytesEnv = "SPYRECCL_INLINE_FUNCTIONAL_MAX_BYTES";
constexpr size_t kDefaultInlineFunctionalMaxBytes = size_t{1} << 20;
// A send or receive. The runner issues it itself (alone, or with its neighbours inside one
// spyrecclGroupStart/End) so that a failure can name the operation's sequence number.
struct PeerCall {
  enum class Kind { kSend, kRecv, kRecvAnySource };
  Kind kind = Kind::kSend;
  int peer = -1;  // kRecvAnySource: unknown until the message arrives
  int tag = 0;
  // kRecvAnySource: where the runner stores the sender's rank.
  std::shared_ptr<int> source;
  // The core does not allow a receive from any source inside a group.
  bool groupable() const { return kind != Kind::kRecvAnySource; }
};

// One core call of an operation and what has to happen around it: before() (e.g. pack a
// tensor list into a flat buffer) → buffers[i].prepare() → the call → buffers[i].commit()
// → after() (e.g. unpack). The call is issue() for collectives and `peerCall` (on
// buffers[0]) for point-to-point steps. Consecutive groupable point-to-point steps of one
// batch are issued together inside spyrecclGroupStart/End, so before()/after() of those
// run outside the group.
struct Step {
  std::vector<CommBuffer> buffers;
  std::function<void()> before;
  std::function<void(const std::vector<CommBuffer>& buffers, spyrecclComm_t comm)> issue;
  std::optional<PeerCall> peerCall;
  std::function<void()> after;
  // The sequence number of the operation the step belongs to (set by submit).
  uint64_t seq = 0;
  flight::Ref trace;  // the operation's flight recorder entry (set by submit)
};

// Everything ProcessGroupSpyreccl::submit needs to know about one operation.
struct OpRecord {
  c10d::OpType type = c10d::OpType::UNKNOWN;
  const char* name = "";             // c10d method name, for messages
  const char* profilingTitle = "";   // "spyreccl:all_reduce", shown by torch.profiler
  std::vector<at::Tensor> inputs;    // profiler inputs
  std::vector<at::Tensor> outputs;   // Work::result() / future value
  std::vector<c10::Device> devices;  // device list of the future
  std::vector<Step> steps;
  std::chrono::milliseconds timeout{-1};  // kUnsetTimeout: the group's timeout
  // The c10d options' asyncOp: false when the caller waits on the Work right away
  // (torch.distributed's async_op=False), which allows running the operation inline.
  bool asyncOp = true;
  // recvAnysource: where the runner stores the sender's rank.
  std::shared_ptr<int> sourceRank;
  // RECORD_PARAM_COMMS metadata
  int64_t inNelems = 0;
  int64_t outNelems = 0;
  at::ScalarType dtype = at::kByte;
  std::vector<int64_t> inSplitSizes;
  std::vector<int64_t> outSplitSizes;
};

// What submit() returns for an operation it ran without a Work (runWaited): one completed
// Work shared by all of them, which the functional kernels recognise and do not register.
const c10::intrusive_ptr<c10d::Work>& ranWithoutWork();

class ProcessGroupSpyreccl : public c10d::Backend {
 public:
  struct Options : c10d::Backend::Options, compat::OptionsGroupDesc {
    explicit Options(std::chrono::milliseconds timeout = kBackendDefaultTimeout);

    static c10::intrusive_ptr<Options> create(
        std::chrono::milliseconds timeout = kBackendDefaultTimeout) {
      return c10::make_intrusive<Options>(timeout);
    }
    // A copy, as our Options (clone() is torch's, returning the base type from torch 2.14 on).
    c10::intrusive_ptr<Options> copy() const { return c10::make_intrusive<Options>(*this); }
    SPYRECCL_COMPAT_OPTIONS_CLONE_OVERRIDE

    // Staging bytes per rank per pipeline slot of the collectives; 0 = the core's default
    // (env SPYRECCL_CHUNK_BYTES or 1 MiB).
    size_t chunk_bytes = 0;
    // Staging bytes per ordered rank pair for send/recv; 0 = the core's default
    // (env SPYRECCL_P2P_CHUNK_BYTES or 256 KiB).
    size_t p2p_chunk_bytes = 0;
    // How long a wait yields the CPU before it sleeps, in ns (spyrecclConfig_t::yieldNs);
    // -1 = the core's default (env SPYRECCL_YIELD_NS or 2 ms). Shorten it for groups whose
    // waits are long (ranks waiting for transfers between hosts).
    int64_t yield_ns = -1;
  };

  // Collective over the `size` ranks of the group: rank 0 creates the communicator id and
  // publishes it in `store`, the others fetch it (bounded by options->timeout).
  ProcessGroupSpyreccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       c10::intrusive_ptr<Options> options = Options::create());
  ~ProcessGroupSpyreccl() override;

  const std::string getBackendName() const override { return kBackendName; }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  c10::intrusive_ptr<Options> getOptions() const { return options_; }

  bool supportsSplitting() const override { return true; }
  bool supportsCoalescing() const override { return true; }

  // --- collectives -----------------------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Blocking barrier bounded by opts.timeout (or the group timeout). spyreccl cannot tell
  // late ranks apart from a barrier alone, so on failure the core's message (which names
  // the peers it waited for) is reported; the communicator is unusable afterwards.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  // --- coalescing: operations between start and end form one batch with one Work; the
  // point-to-point ones run inside spyrecclGroupStart/End so that batch_isend_irecv cannot
  // deadlock; collectives run in order.
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // --- group management -------------------------------------------------------------------
  // Collective over all ranks of this group (ranks are group ranks). Returns nullptr on
  // ranks outside `ranks`.
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;
  // Aborts the communicator (unblocking a running operation), fails queued operations and
  // stops the progress thread. Idempotent.
  void abort() override;
  // Finishes queued operations, stops the progress thread and releases the communicator.
  void shutdown() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  c10d::ErrorType getError() override;
  // The core's state dump of this group's communicator (recent operations, peer states).
  std::string dumpState() const;
  // Leaves this group out of the flight recorder (see flight_recorder.h).
  void disableFlightRecorder() { trace_.disable(); }
  // Makes this group a stage of a multi-node group in the flight recorder (see
  // flight_recorder.h): its failures dump once, as that group's.
  void setFlightParent(int64_t parent) { trace_.setParent(parent); }

 private:
  struct SplitTag {};
  // Wraps a communicator created by spyrecclCommSplit.
  ProcessGroupSpyreccl(SplitTag, std::shared_ptr<Communicator> comm, int rank, int size,
                       c10::intrusive_ptr<Options> options);

  void startProgressThread();
  // Per-group constants computed once (label, profiler rank layout, inline threshold).
  void cacheConstants();
  void checkUsable(const char* opName) const;
  const std::string& label() const { return *label_; }
  // Whether `op` may run on the calling thread (see the inline fast path in submit()).
  bool runsInline(const OpRecord& op) const;
  // Whether `op`, a lone send or receive, is posted on the calling thread (submit()).
  bool postsInline(const OpRecord& op) const;
  void recordParamComms(const OpRecord& op, uint64_t seq);
  std::chrono::milliseconds effectiveTimeout(std::chrono::milliseconds requested) const;
  // send / recv / recvAnysource: validation and the one step they share.
  c10::intrusive_ptr<c10d::Work> pointToPoint(std::vector<at::Tensor>& tensors, PeerCall call);
  // Queues the operation (or adds it to the open coalescing batch, or runs it inline) and
  // returns its Work.
  c10::intrusive_ptr<c10d::Work> submit(OpRecord op);
  // Within a WorkOptionalScope (a functional collective waited at once): runs `op` on the
  // calling thread without a Work when submit() would run it inline and nothing observes a
  // Work (no coalescing batch open, no record-function callbacks: the profiler's range and
  // param-comms event live with the Work). Errors are thrown as the Work's wait() would
  // throw them. Returns false, touching nothing, otherwise.
  bool runWaited(OpRecord& op);
  // Gives `op` the group's next sequence number (and its steps, for their messages) and
  // returns it: every operation takes one, with or without a Work, so that the numbers
  // stay the same on every rank.
  uint64_t numberOp(OpRecord& op);
  // Queues a job on the progress thread; `work`'s waiter may run it itself while the
  // thread has not started it (WorkSpyreccl::setRunner): a collective through
  // ProgressThread::runIfNext, a lone send or receive (whose run() leaves it in flight)
  // through ProgressThread::drive. Returns the job's ticket.
  uint64_t post(const c10::intrusive_ptr<WorkSpyreccl>& work,
                std::unique_ptr<ProgressThread::Job> job, bool lonePeerCall);
  // Runs `fn(comm)` on the progress thread after everything queued before it and waits.
  void runSynchronously(const char* opName, std::chrono::milliseconds timeout,
                        std::function<void(spyrecclComm_t)> fn);

  c10::intrusive_ptr<Options> options_;
  // "process group 'name' (rank r of n)", shared with the Works for their messages.
  std::shared_ptr<const std::string> label_;
  // Rank layout of the group in the default group, for the profiler's comms metadata.
  int globalRankStart_ = 0;
  int globalRankStride_ = 1;
  // Largest payload (bytes) of a synchronous collective that runs inline on the calling
  // thread; 0 disables the inline path.
  size_t inlineMaxBytes_ = 0;
  // The same for functional collectives (kInlineFunctionalMaxBytesEnv).
  size_t inlineFunctionalMaxBytes_ = 0;
  std::shared_ptr<Communicator> comm_;
  // Shared with the Works of queued collectives, which may run their operation on the
  // thread that waits for it (WorkSpyreccl::setRunner).
  std::shared_ptr<ProgressThread> progress_;
  // Serialises posting to the progress thread with running inline, across every thread
  // that uses this group: progress_->idle() only orders an inline operation after jobs
  // posted before it, so without this a job posted by another thread could start on the
  // communicator while an inline operation still runs (the core allows one thread at a
  // time per communicator).
  std::mutex submitMutex_;
  std::atomic<uint64_t> seq_{0};
  flight::GroupSlot trace_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> shutDown_{false};
  // The process that made the group; a child forked later inherits the object but not the
  // progress thread, and must not tear it down (see the destructor).
  const pid_t creatorPid_ = getpid();

  // Open coalescing batch (between startCoalescing and endCoalescing).
  bool coalescing_ = false;
  c10::intrusive_ptr<WorkSpyreccl> batchWork_;
  OpRecord batch_;
};

}  // namespace spyreccl_torch

// The C API: argument validation, exception -> result code translation, last error.
//
// Every entry point runs its body inside guarded(): validation first (failures return
// spyrecclInvalidArgument and leave the communicator usable), then `communicating = true`
// and the algorithm; any error after that point marks the communicator failed, and later
// calls return spyrecclInvalidUsage naming the original error. No exception escapes.
//
// Where the message of a failure goes: every entry point that receives a communicator
// passes it to guarded(), so the message is recorded on that communicator (queries and
// setters included); only calls without one (or with comm == NULL) record it in the
// calling thread's slot. spyrecclGetLastError reads the same place back.
#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "algorithms/collectives.h"
#include "algorithms/p2p.h"
#include "comm.h"
#include "common/error.h"
#include "common/log.h"
#include "kernels/reduce.h"
#include "memory/arena.h"
#include "rendezvous/bootstrap.h"
#include "rendezvous/unique_id.h"
#include "spyreccl/spyreccl.h"
#include "transport/wait.h"

using spyreccl::Error;
using spyreccl::format;
namespace algorithms = spyreccl::algorithms;
namespace kernels = spyreccl::kernels;

namespace {

constexpr int kMaxRanks = 4096;

// Last error of calls made by this thread without a communicator (spyrecclGetLastError(NULL)).
thread_local std::string tlsLastError;

// Records `message` where spyrecclGetLastError will look for it, marks the communicator
// failed when the error interrupted communication, and logs it with its source location.
spyrecclResult_t report(spyrecclComm* comm, spyrecclResult_t code, const std::string& message,
                        const char* file, int line, bool communicating) {
  if (comm != nullptr) {
    if (communicating && code != spyrecclInvalidArgument) comm->markFailed(code, message);
    comm->setLastError(message);
  } else {
    tlsLastError = message;
  }
  SPYRECCL_LOG(kWarn, comm ? comm->who().c_str() : nullptr, "%s [%s:%d]", message.c_str(), file,
               line);
  return code;
}

// Runs `body(bool& communicating)` for C API function `api` and converts every exception into
// a result code; `comm` (may be NULL) is where the error is recorded. The body sets
// `communicating` once validation is over: from then on an error breaks the communicator.
template <class Body>
spyrecclResult_t guarded(spyrecclComm* comm, const char* api, Body&& body) noexcept {
  bool communicating = false;
  try {
    body(communicating);
    return spyrecclSuccess;
  } catch (const Error& e) {
    return report(comm, e.code(), e.message(), e.file(), e.line(), communicating);
  } catch (const std::bad_alloc&) {
    return report(comm, spyrecclSystemError, format("%s: out of memory", api), __FILE__, __LINE__,
                  communicating);
  } catch (const std::exception& e) {
    return report(comm, spyrecclInternalError,
                  format("%s: internal error (unexpected exception: %s)", api, e.what()), __FILE__,
                  __LINE__, communicating);
  } catch (...) {
    return report(comm, spyrecclInternalError,
                  format("%s: internal error (unknown exception)", api), __FILE__, __LINE__,
                  communicating);
  }
}

// ---- validation helpers ------------------------------------------------------------------

void checkComm(const spyrecclComm* comm, const char* api) {
  SPYRECCL_CHECK_ARG(comm != nullptr, api, "argument 'comm' is NULL");
}

// The integer behind an enum argument, read without loading the enum: a C caller may pass
// any int, and loading an out-of-range value as the enum type is undefined in C++.
template <class E>
int rawValue(const E& e) {
  static_assert(sizeof(E) == sizeof(int), "C API enums are int sized");
  int v;
  std::memcpy(&v, &e, sizeof(v));
  return v;
}

size_t checkDtype(const spyrecclDataType_t& dtype, const char* api) {
  int v = rawValue(dtype);
  SPYRECCL_CHECK_ARG(v >= 0 && v < spyrecclNumTypes, api,
                     "argument 'datatype' = %d is not a valid spyrecclDataType_t", v);
  return kernels::dtypeSize(dtype);
}

// count * esize * multiple bytes, rejecting overflow.
size_t checkedBytes(size_t count, size_t esize, size_t multiple, const char* arg, const char* api) {
  size_t bytes = 0;
  bool overflow = __builtin_mul_overflow(count, esize, &bytes) ||
                  __builtin_mul_overflow(bytes, multiple, &bytes) || bytes > (size_t{1} << 62);
  SPYRECCL_CHECK_ARG(!overflow, api, "argument '%s' = %zu is too large (byte size overflows)", arg,
                     count);
  return bytes;
}

void checkRoot(int root, const spyrecclComm* comm, const char* api) {
  SPYRECCL_CHECK_ARG(root >= 0 && root < comm->nranks(), api,
                     "argument 'root' = %d is out of range [0, %d)", root, comm->nranks());
}

void checkBuffer(const void* p, size_t bytes, const char* arg, const char* api) {
  SPYRECCL_CHECK_ARG(p != nullptr || bytes == 0, api,
                     "argument '%s' is NULL but the operation moves %zu bytes through it", arg,
                     bytes);
}

bool overlaps(const void* a, size_t alen, const void* b, size_t blen) {
  if (alen == 0 || blen == 0 || a == nullptr || b == nullptr) return false;
  auto pa = reinterpret_cast<uintptr_t>(a);
  auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + blen && pb < pa + alen;
}

// Buffers must either be exactly the in-place configuration or not overlap at all.
void checkOverlap(const void* send, size_t sendBytes, const void* recv, size_t recvBytes,
                  bool inPlace, const char* inPlaceRule, const char* api) {
  SPYRECCL_CHECK_ARG(inPlace || !overlaps(send, sendBytes, recv, recvBytes), api,
                     "arguments 'sendbuff' [%p, +%zu bytes) and 'recvbuff' [%p, +%zu bytes) "
                     "overlap; %s",
                     send, sendBytes, recv, recvBytes, inPlaceRule);
}

void checkNotInGroup(const char* api) {
  if (algorithms::threadGroup().depth > 0) {
    SPYRECCL_THROW(spyrecclInvalidUsage,
                   "%s: collectives are not allowed between spyrecclGroupStart and "
                   "spyrecclGroupEnd (only spyrecclSend/spyrecclRecv are grouped)",
                   api);
  }
}

// Common prologue of every collective: comm non-NULL, dtype valid.
size_t collectivePrologue(const spyrecclComm* comm, const spyrecclDataType_t& dtype,
                          const char* api) {
  checkComm(comm, api);
  return checkDtype(dtype, api);
}

void startCommunication(spyrecclComm* comm, const char* api, bool& communicating) {
  checkNotInGroup(api);
  comm->ensureUsable(api);
  communicating = true;
}

const uint8_t* bytePtr(const void* p) { return static_cast<const uint8_t*>(p); }

}  // namespace

extern "C" {

// ---------------------------------------------------------------------------------------
// library information and errors
// ---------------------------------------------------------------------------------------

spyrecclResult_t spyrecclGetVersion(int* version) {
  return guarded(nullptr, "spyrecclGetVersion", [&](bool&) {
    SPYRECCL_CHECK_ARG(version != nullptr, "spyrecclGetVersion", "argument 'version' is NULL");
    *version = SPYRECCL_VERSION_CODE;
  });
}

const char* spyrecclGetErrorString(spyrecclResult_t result) {
  switch (result) {
    case spyrecclSuccess:
      return "spyrecclSuccess: no error";
    case spyrecclSystemError:
      return "spyrecclSystemError: an operating system call failed";
    case spyrecclInternalError:
      return "spyrecclInternalError: internal error in spyreccl";
    case spyrecclInvalidArgument:
      return "spyrecclInvalidArgument: invalid argument";
    case spyrecclInvalidUsage:
      return "spyrecclInvalidUsage: invalid usage (call out of order, unusable communicator or "
             "bad unique id)";
    case spyrecclRemoteError:
      return "spyrecclRemoteError: a peer rank died, aborted or left";
    case spyrecclTimeout:
      return "spyrecclTimeout: a wait exceeded the communicator timeout";
    case spyrecclAborted:
      return "spyrecclAborted: the communicator was aborted";
    case spyrecclMismatch:
      return "spyrecclMismatch: ranks called different operations or arguments";
    case spyrecclUnsupported:
      return "spyrecclUnsupported: unsupported request";
    case spyrecclNumResults:
      break;
  }
  return "unknown spyrecclResult_t value";
}

const char* spyrecclGetLastError(spyrecclComm_t comm) {
  return comm != nullptr ? comm->lastError() : tlsLastError.c_str();
}

// The names are the library's own (kernels::dtypeName, also used in every message that
// names a data type), so that API users and error messages spell types the same way.
const char* spyrecclGetDataTypeName(spyrecclDataType_t datatype) {
  const int v = rawValue(datatype);
  if (v < 0 || v >= spyrecclNumTypes) return nullptr;
  return kernels::dtypeName(datatype);
}

size_t spyrecclGetDataTypeSize(spyrecclDataType_t datatype) {
  const int v = rawValue(datatype);
  if (v < 0 || v >= spyrecclNumTypes) return 0;
  return kernels::dtypeSize(datatype);
}

// ---------------------------------------------------------------------------------------
// communicator lifecycle
// ---------------------------------------------------------------------------------------

spyrecclResult_t spyrecclGetUniqueId(spyrecclUniqueId* uniqueId) {
  const char* api = "spyrecclGetUniqueId";
  return guarded(nullptr, api, [&](bool&) {
    SPYRECCL_CHECK_ARG(uniqueId != nullptr, api, "argument 'uniqueId' is NULL");
    spyreccl::rendezvous::UniqueIdData id = spyreccl::rendezvous::makeUniqueId();
    std::memcpy(uniqueId->internal, &id, sizeof(id));
  });
}

spyrecclResult_t spyrecclCommInitRank(spyrecclComm_t* comm, int nranks, spyrecclUniqueId id,
                                      int rank, const spyrecclConfig_t* config) {
  const char* api = "spyrecclCommInitRank";
  return guarded(nullptr, api, [&](bool&) {
    SPYRECCL_CHECK_ARG(comm != nullptr, api, "argument 'comm' is NULL");
    *comm = nullptr;
    SPYRECCL_CHECK_ARG(nranks >= 1 && nranks <= kMaxRanks, api,
                       "argument 'nranks' = %d is out of range [1, %d]", nranks, kMaxRanks);
    SPYRECCL_CHECK_ARG(rank >= 0 && rank < nranks, api,
                       "argument 'rank' = %d is out of range [0, %d)", rank, nranks);
    spyreccl::CommConfig cfg = spyreccl::resolveConfig(config, nranks, api);
    spyreccl::rendezvous::UniqueIdData data = spyreccl::rendezvous::decodeUniqueId(id);
    spyreccl::rendezvous::checkSameHost(data, rank);
    *comm = spyreccl::rendezvous::bootstrap(nranks, data, rank, cfg).release();
  });
}

spyrecclResult_t spyrecclCommSplit(spyrecclComm_t comm, int color, int key, spyrecclComm_t* newcomm,
                                   const spyrecclConfig_t* config) {
  const char* api = "spyrecclCommSplit";
  return guarded(comm, api, [&](bool& communicating) {
    checkComm(comm, api);
    SPYRECCL_CHECK_ARG(newcomm != nullptr, api, "argument 'newcomm' is NULL");
    *newcomm = nullptr;
    SPYRECCL_CHECK_ARG(color >= 0 || color == SPYRECCL_SPLIT_NOCOLOR, api,
                       "argument 'color' = %d must be >= 0 or SPYRECCL_SPLIT_NOCOLOR", color);
    spyreccl::CommConfig inherit = comm->config();
    inherit.timeoutMs = comm->timeoutMs();
    // Validated now so that a bad config fails before any communication; the final
    // rounding depends on the new size and is redone below.
    spyreccl::resolveConfig(config, comm->nranks(), api, &inherit);
    startCommunication(comm, api, communicating);
    algorithms::SplitPlan plan = algorithms::splitExchange(*comm, color, key);
    // The parent's part is complete: a failure to set up the child leaves the parent usable.
    communicating = false;
    if (!plan.member) return;
    spyreccl::CommConfig cfg = spyreccl::resolveConfig(config, plan.newSize, api, &inherit);
    *newcomm = spyreccl::rendezvous::bootstrap(plan.newSize, plan.id, plan.newRank, cfg).release();
  });
}

spyrecclResult_t spyrecclCommDestroy(spyrecclComm_t comm) {
  // Nothing to record an error on: the communicator is going away, so errors (none are
  // expected) go to the calling thread.
  return guarded(nullptr, "spyrecclCommDestroy", [&](bool&) {
    if (comm == nullptr) return;
    // Forget operations of this thread's open group that reference the communicator.
    auto& ops = algorithms::threadGroup().ops;
    ops.erase(std::remove_if(ops.begin(), ops.end(),
                             [comm](const algorithms::P2POp& op) { return op.comm == comm; }),
              ops.end());
    delete comm;
  });
}

spyrecclResult_t spyrecclCommAbort(spyrecclComm_t comm) {
  const char* api = "spyrecclCommAbort";
  return guarded(comm, api, [&](bool&) {
    checkComm(comm, api);
    comm->abort();
  });
}

spyrecclResult_t spyrecclCommCount(const spyrecclComm_t comm, int* count) {
  const char* api = "spyrecclCommCount";
  return guarded(comm, api, [&](bool&) {
    checkComm(comm, api);
    SPYRECCL_CHECK_ARG(count != nullptr, api, "argument 'count' is NULL");
    *count = comm->nranks();
  });
}

spyrecclResult_t spyrecclCommUserRank(const spyrecclComm_t comm, int* rank) {
  const char* api = "spyrecclCommUserRank";
  return guarded(comm, api, [&](bool&) {
    checkComm(comm, api);
    SPYRECCL_CHECK_ARG(rank != nullptr, api, "argument 'rank' is NULL");
    *rank = comm->rank();
  });
}

spyrecclResult_t spyrecclCommSetTimeout(spyrecclComm_t comm, int64_t timeoutMs) {
  const char* api = "spyrecclCommSetTimeout";
  return guarded(comm, api, [&](bool&) {
    checkComm(comm, api);
    SPYRECCL_CHECK_ARG(timeoutMs > 0, api, "argument 'timeoutMs' = %lld must be > 0",
                       static_cast<long long>(timeoutMs));
    comm->setTimeoutMs(timeoutMs);
  });
}

spyrecclResult_t spyrecclCommGetAsyncError(spyrecclComm_t comm, spyrecclResult_t* asyncError) {
  const char* api = "spyrecclCommGetAsyncError";
  return guarded(comm, api, [&](bool&) {
    checkComm(comm, api);
    SPYRECCL_CHECK_ARG(asyncError != nullptr, api, "argument 'asyncError' is NULL");
    *asyncError = comm->asyncError();
  });
}

spyrecclResult_t spyrecclCommDumpState(spyrecclComm_t comm, char* buf, size_t len) {
  const char* api = "spyrecclCommDumpState";
  return guarded(comm, api, [&](bool&) {
    checkComm(comm, api);
    SPYRECCL_CHECK_ARG(buf != nullptr && len > 0, api,
                       "argument 'buf' must be non-NULL with 'len' > 0 (got %p, %zu)",
                       static_cast<void*>(buf), len);
    std::string dump = comm->dumpState();
    size_t n = std::min(dump.size(), len - 1);
    std::memcpy(buf, dump.data(), n);
    buf[n] = '\0';
  });
}

spyrecclResult_t spyrecclRedOpCreatePreMulSum(spyrecclRedOp_t* op, double scalar,
                                              spyrecclDataType_t datatype, spyrecclComm_t comm) {
  const char* api = "spyrecclRedOpCreatePreMulSum";
  return guarded(comm, api, [&](bool&) {
    checkComm(comm, api);
    SPYRECCL_CHECK_ARG(op != nullptr, api, "argument 'op' is NULL");
    checkDtype(datatype, api);
    *op = comm->createPreMulSum(scalar, datatype);
  });
}

spyrecclResult_t spyrecclRedOpDestroy(spyrecclRedOp_t op, spyrecclComm_t comm) {
  const char* api = "spyrecclRedOpDestroy";
  return guarded(comm, api, [&](bool&) {
    checkComm(comm, api);
    comm->destroyRedOp(rawValue(op));
  });
}

// ---------------------------------------------------------------------------------------
// collectives
// ---------------------------------------------------------------------------------------

spyrecclResult_t spyrecclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                   spyrecclDataType_t datatype, spyrecclRedOp_t op,
                                   spyrecclComm_t comm) {
  const char* api = "spyrecclAllReduce";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t bytes = checkedBytes(count, esize, 1, "count", api);
    kernels::ReduceSpec spec = comm->resolveOp(rawValue(op), datatype, api);
    checkBuffer(sendbuff, bytes, "sendbuff", api);
    checkBuffer(recvbuff, bytes, "recvbuff", api);
    checkOverlap(sendbuff, bytes, recvbuff, bytes, sendbuff == recvbuff,
                 "in place requires sendbuff == recvbuff", api);
    startCommunication(comm, api, communicating);
    algorithms::allReduce(*comm, sendbuff, recvbuff, count, datatype, op, spec);
  });
}

spyrecclResult_t spyrecclReduce(const void* sendbuff, void* recvbuff, size_t count,
                                spyrecclDataType_t datatype, spyrecclRedOp_t op, int root,
                                spyrecclComm_t comm) {
  const char* api = "spyrecclReduce";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t bytes = checkedBytes(count, esize, 1, "count", api);
    kernels::ReduceSpec spec = comm->resolveOp(rawValue(op), datatype, api);
    checkRoot(root, comm, api);
    checkBuffer(sendbuff, bytes, "sendbuff", api);
    if (comm->rank() == root) {
      checkBuffer(recvbuff, bytes, "recvbuff", api);
      checkOverlap(sendbuff, bytes, recvbuff, bytes, sendbuff == recvbuff,
                   "in place requires sendbuff == recvbuff", api);
    }
    startCommunication(comm, api, communicating);
    algorithms::reduce(*comm, sendbuff, recvbuff, count, datatype, op, spec, root);
  });
}

spyrecclResult_t spyrecclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                                   spyrecclDataType_t datatype, int root, spyrecclComm_t comm) {
  const char* api = "spyrecclBroadcast";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t bytes = checkedBytes(count, esize, 1, "count", api);
    checkRoot(root, comm, api);
    checkBuffer(recvbuff, bytes, "recvbuff", api);
    if (comm->rank() == root) {
      checkBuffer(sendbuff, bytes, "sendbuff", api);
      checkOverlap(sendbuff, bytes, recvbuff, bytes, sendbuff == recvbuff,
                   "in place requires sendbuff == recvbuff", api);
    }
    startCommunication(comm, api, communicating);
    algorithms::broadcast(*comm, sendbuff, recvbuff, count, datatype, root);
  });
}

spyrecclResult_t spyrecclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                   spyrecclDataType_t datatype, spyrecclComm_t comm) {
  const char* api = "spyrecclAllGather";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t bytes = checkedBytes(sendcount, esize, 1, "sendcount", api);
    size_t total = checkedBytes(sendcount, esize, comm->nranks(), "sendcount", api);
    checkBuffer(sendbuff, bytes, "sendbuff", api);
    checkBuffer(recvbuff, total, "recvbuff", api);
    bool inPlace =
        recvbuff != nullptr && bytePtr(sendbuff) == bytePtr(recvbuff) + comm->rank() * bytes;
    checkOverlap(sendbuff, bytes, recvbuff, total, inPlace,
                 "in place requires sendbuff == recvbuff + rank * sendcount", api);
    startCommunication(comm, api, communicating);
    algorithms::allGather(*comm, sendbuff, recvbuff, sendcount, datatype);
  });
}

spyrecclResult_t spyrecclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                       spyrecclDataType_t datatype, spyrecclRedOp_t op,
                                       spyrecclComm_t comm) {
  const char* api = "spyrecclReduceScatter";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t bytes = checkedBytes(recvcount, esize, 1, "recvcount", api);
    size_t total = checkedBytes(recvcount, esize, comm->nranks(), "recvcount", api);
    kernels::ReduceSpec spec = comm->resolveOp(rawValue(op), datatype, api);
    checkBuffer(sendbuff, total, "sendbuff", api);
    checkBuffer(recvbuff, bytes, "recvbuff", api);
    bool inPlace =
        sendbuff != nullptr && bytePtr(recvbuff) == bytePtr(sendbuff) + comm->rank() * bytes;
    checkOverlap(sendbuff, total, recvbuff, bytes, inPlace,
                 "in place requires recvbuff == sendbuff + rank * recvcount", api);
    startCommunication(comm, api, communicating);
    algorithms::reduceScatter(*comm, sendbuff, recvbuff, recvcount, datatype, op, spec);
  });
}

spyrecclResult_t spyrecclAllToAll(const void* sendbuff, void* recvbuff, size_t count,
                                  spyrecclDataType_t datatype, spyrecclComm_t comm) {
  const char* api = "spyrecclAllToAll";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t total = checkedBytes(count, esize, comm->nranks(), "count", api);
    checkBuffer(sendbuff, total, "sendbuff", api);
    checkBuffer(recvbuff, total, "recvbuff", api);
    checkOverlap(sendbuff, total, recvbuff, total, false,
                 "spyrecclAllToAll does not support in-place operation", api);
    startCommunication(comm, api, communicating);
    algorithms::allToAll(*comm, sendbuff, recvbuff, count, datatype);
  });
}

spyrecclResult_t spyrecclAllToAllv(const void* sendbuff, const size_t* sendcounts,
                                   const size_t* sdispls, void* recvbuff, const size_t* recvcounts,
                                   const size_t* rdispls, spyrecclDataType_t datatype,
                                   spyrecclComm_t comm) {
  const char* api = "spyrecclAllToAllv";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    SPYRECCL_CHECK_ARG(sendcounts && sdispls && recvcounts && rdispls, api,
                       "arguments 'sendcounts', 'sdispls', 'recvcounts' and 'rdispls' must all "
                       "be non-NULL arrays of nranks entries");
    // Extent of each buffer: the end of its farthest block.
    auto extent = [&](const size_t* counts, const size_t* displs, const char* name) {
      size_t end = 0;
      for (int p = 0; p < comm->nranks(); ++p) {
        size_t e = 0;
        SPYRECCL_CHECK_ARG(!__builtin_add_overflow(counts[p], displs[p], &e), api,
                           "argument '%s'[%d] + displacement overflows", name, p);
        if (counts[p]) end = std::max(end, checkedBytes(e, esize, 1, name, api));
      }
      return end;
    };
    size_t sendExtent = extent(sendcounts, sdispls, "sendcounts");
    size_t recvExtent = extent(recvcounts, rdispls, "recvcounts");
    checkBuffer(sendbuff, sendExtent, "sendbuff", api);
    checkBuffer(recvbuff, recvExtent, "recvbuff", api);
    checkOverlap(sendbuff, sendExtent, recvbuff, recvExtent, false,
                 "spyrecclAllToAllv does not support in-place operation", api);
    SPYRECCL_CHECK_ARG(sendcounts[comm->rank()] == recvcounts[comm->rank()], api,
                       "sendcounts[%d] = %zu (to this rank) differs from recvcounts[%d] = %zu",
                       comm->rank(), sendcounts[comm->rank()], comm->rank(),
                       recvcounts[comm->rank()]);
    startCommunication(comm, api, communicating);
    algorithms::allToAllv(*comm, sendbuff, sendcounts, sdispls, recvbuff, recvcounts, rdispls,
                          datatype);
  });
}

spyrecclResult_t spyrecclGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                spyrecclDataType_t datatype, int root, spyrecclComm_t comm) {
  const char* api = "spyrecclGather";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t bytes = checkedBytes(sendcount, esize, 1, "sendcount", api);
    size_t total = checkedBytes(sendcount, esize, comm->nranks(), "sendcount", api);
    checkRoot(root, comm, api);
    checkBuffer(sendbuff, bytes, "sendbuff", api);
    if (comm->rank() == root) {
      checkBuffer(recvbuff, total, "recvbuff", api);
      bool inPlace = recvbuff != nullptr && bytePtr(sendbuff) == bytePtr(recvbuff) + root * bytes;
      checkOverlap(sendbuff, bytes, recvbuff, total, inPlace,
                   "in place requires sendbuff == recvbuff + root * sendcount", api);
    }
    startCommunication(comm, api, communicating);
    algorithms::gather(*comm, sendbuff, recvbuff, sendcount, datatype, root);
  });
}

spyrecclResult_t spyrecclScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                 spyrecclDataType_t datatype, int root, spyrecclComm_t comm) {
  const char* api = "spyrecclScatter";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t bytes = checkedBytes(recvcount, esize, 1, "recvcount", api);
    size_t total = checkedBytes(recvcount, esize, comm->nranks(), "recvcount", api);
    checkRoot(root, comm, api);
    checkBuffer(recvbuff, bytes, "recvbuff", api);
    if (comm->rank() == root) {
      checkBuffer(sendbuff, total, "sendbuff", api);
      bool inPlace = sendbuff != nullptr && bytePtr(recvbuff) == bytePtr(sendbuff) + root * bytes;
      checkOverlap(sendbuff, total, recvbuff, bytes, inPlace,
                   "in place requires recvbuff == sendbuff + root * recvcount", api);
    }
    startCommunication(comm, api, communicating);
    algorithms::scatter(*comm, sendbuff, recvbuff, recvcount, datatype, root);
  });
}

spyrecclResult_t spyrecclBarrier(spyrecclComm_t comm) {
  const char* api = "spyrecclBarrier";
  return guarded(comm, api, [&](bool& communicating) {
    checkComm(comm, api);
    startCommunication(comm, api, communicating);
    algorithms::barrier(*comm);
  });
}

// ---------------------------------------------------------------------------------------
// point-to-point
// ---------------------------------------------------------------------------------------

namespace {

algorithms::P2POp makeP2P(spyrecclComm* comm, bool isSend, const void* buff, size_t count,
                          const spyrecclDataType_t& datatype, int peer, int tag, const char* api) {
  size_t esize = collectivePrologue(comm, datatype, api);
  size_t bytes = checkedBytes(count, esize, 1, "count", api);
  SPYRECCL_CHECK_ARG(peer >= 0 && peer < comm->nranks(), api,
                     "argument 'peer' = %d is out of range [0, %d)", peer, comm->nranks());
  SPYRECCL_CHECK_ARG(peer != comm->rank(), api,
                     "argument 'peer' = %d is this rank; a rank cannot %s itself", peer,
                     isSend ? "send to" : "receive from");
  checkBuffer(buff, bytes, isSend ? "sendbuff" : "recvbuff", api);
  algorithms::P2POp op;
  op.comm = comm;
  op.isSend = isSend;
  op.peer = peer;
  op.tag = tag;
  op.dtype = datatype;
  op.count = count;
  op.sendBuf = static_cast<const uint8_t*>(buff);
  op.recvBuf = static_cast<uint8_t*>(const_cast<void*>(buff));
  return op;
}

spyrecclResult_t pointToPoint(spyrecclComm* comm, bool isSend, const void* buff, size_t count,
                              const spyrecclDataType_t& datatype, int peer, int tag,
                              const char* api) {
  return guarded(comm, api, [&](bool& communicating) {
    algorithms::P2POp op = makeP2P(comm, isSend, buff, count, datatype, peer, tag, api);
    comm->ensureUsable(api);
    algorithms::GroupState& group = algorithms::threadGroup();
    if (group.depth > 0) {
      group.ops.push_back(op);
      return;
    }
    communicating = true;
    std::vector<algorithms::P2POp> ops{op};
    algorithms::runP2P(ops);
  });
}

}  // namespace

spyrecclResult_t spyrecclSend(const void* sendbuff, size_t count, spyrecclDataType_t datatype,
                              int peer, int tag, spyrecclComm_t comm) {
  return pointToPoint(comm, true, sendbuff, count, datatype, peer, tag, "spyrecclSend");
}

spyrecclResult_t spyrecclRecv(void* recvbuff, size_t count, spyrecclDataType_t datatype, int peer,
                              int tag, spyrecclComm_t comm) {
  return pointToPoint(comm, false, recvbuff, count, datatype, peer, tag, "spyrecclRecv");
}

spyrecclResult_t spyrecclRecvAnySource(void* recvbuff, size_t count, spyrecclDataType_t datatype,
                                       int tag, int* source, spyrecclComm_t comm) {
  const char* api = "spyrecclRecvAnySource";
  return guarded(comm, api, [&](bool& communicating) {
    size_t esize = collectivePrologue(comm, datatype, api);
    size_t bytes = checkedBytes(count, esize, 1, "count", api);
    checkBuffer(recvbuff, bytes, "recvbuff", api);
    SPYRECCL_CHECK_ARG(source != nullptr, api, "argument 'source' is NULL");
    SPYRECCL_CHECK_ARG(comm->nranks() > 1, api,
                       "the communicator has a single rank: there is no other source");
    if (algorithms::threadGroup().depth > 0) {
      SPYRECCL_THROW(spyrecclInvalidUsage,
                     "%s: not allowed between spyrecclGroupStart and spyrecclGroupEnd", api);
    }
    comm->ensureUsable(api);
    communicating = true;
    *source = algorithms::recvAnySource(*comm, recvbuff, count, datatype, tag);
  });
}

// ---------------------------------------------------------------------------------------
// non-blocking point-to-point
// ---------------------------------------------------------------------------------------

namespace {

algorithms::P2POp* fromHandle(spyrecclRequest_t request) {
  return reinterpret_cast<algorithms::P2POp*>(request);
}

spyrecclResult_t postRequest(spyrecclComm* comm, bool isSend, const void* buff, size_t count,
                             const spyrecclDataType_t& datatype, int peer, int tag,
                             spyrecclRequest_t* request, const char* api) {
  return guarded(comm, api, [&](bool& communicating) {
    SPYRECCL_CHECK_ARG(request != nullptr, api, "argument 'request' is NULL");
    *request = nullptr;
    algorithms::P2POp op = makeP2P(comm, isSend, buff, count, datatype, peer, tag, api);
    if (algorithms::threadGroup().depth > 0) {
      SPYRECCL_THROW(spyrecclInvalidUsage,
                     "%s: not allowed between spyrecclGroupStart and spyrecclGroupEnd (use "
                     "spyrecclSend/spyrecclRecv there)",
                     api);
    }
    comm->ensureUsable(api);
    auto owned = std::make_unique<algorithms::P2POp>(std::move(op));
    algorithms::P2POp* posted = owned.get();
    comm->requests().push_back(std::move(owned));
    algorithms::post(*posted);
    *request = reinterpret_cast<spyrecclRequest_t>(posted);
    communicating = true;
    // A first pass right away: a small send is then complete before the call returns. Its
    // error, if any, is the request's to report (spyrecclTest/Wait).
    try {
      algorithms::progress(*comm);
    } catch (const Error&) {
    }
  });
}

// Releases the finished request `op` of `comm` and throws the error that abandoned it.
void releaseRequest(spyrecclComm* comm, algorithms::P2POp* op) {
  const spyrecclResult_t result = op->result;
  const std::string error = op->error;
  auto& requests = comm->requests();
  requests.erase(std::find_if(requests.begin(), requests.end(),
                              [op](const auto& owned) { return owned.get() == op; }));
  if (result != spyrecclSuccess) throw Error(result, error, __FILE__, __LINE__);
}

}  // namespace

spyrecclResult_t spyrecclIsend(const void* sendbuff, size_t count, spyrecclDataType_t datatype,
                               int peer, int tag, spyrecclComm_t comm, spyrecclRequest_t* request) {
  return postRequest(comm, true, sendbuff, count, datatype, peer, tag, request, "spyrecclIsend");
}

spyrecclResult_t spyrecclIrecv(void* recvbuff, size_t count, spyrecclDataType_t datatype, int peer,
                               int tag, spyrecclComm_t comm, spyrecclRequest_t* request) {
  return postRequest(comm, false, recvbuff, count, datatype, peer, tag, request, "spyrecclIrecv");
}

spyrecclResult_t spyrecclTest(spyrecclRequest_t request, int* done) {
  const char* api = "spyrecclTest";
  algorithms::P2POp* op = fromHandle(request);
  spyrecclComm* comm = op != nullptr ? static_cast<spyrecclComm*>(op->comm) : nullptr;
  return guarded(comm, api, [&](bool&) {
    SPYRECCL_CHECK_ARG(request != nullptr, api, "argument 'request' is NULL");
    SPYRECCL_CHECK_ARG(done != nullptr, api, "argument 'done' is NULL");
    *done = 0;
    if (!op->finished) {
      try {
        algorithms::progress(*comm);
      } catch (const Error&) {
        // progress() abandoned every pending request with the error: ours reports it.
      }
    }
    if (!op->finished) return;
    *done = 1;
    releaseRequest(comm, op);
  });
}

spyrecclResult_t spyrecclWait(spyrecclRequest_t request) {
  const char* api = "spyrecclWait";
  algorithms::P2POp* op = fromHandle(request);
  spyrecclComm* comm = op != nullptr ? static_cast<spyrecclComm*>(op->comm) : nullptr;
  return guarded(comm, api, [&](bool&) {
    SPYRECCL_CHECK_ARG(request != nullptr, api, "argument 'request' is NULL");
    algorithms::waitFor(*op);
    releaseRequest(comm, op);
  });
}

spyrecclResult_t spyrecclCommPoll(spyrecclComm_t comm, int64_t maxWaitUs, int* pending) {
  const char* api = "spyrecclCommPoll";
  return guarded(comm, api, [&](bool& communicating) {
    checkComm(comm, api);
    SPYRECCL_CHECK_ARG(maxWaitUs >= 0, api, "argument 'maxWaitUs' = %lld is negative",
                       static_cast<long long>(maxWaitUs));
    if (pending != nullptr) *pending = 0;
    communicating = true;
    if (!algorithms::progress(*comm) && maxWaitUs > 0 && !comm->pendingP2P().empty()) {
      algorithms::waitProgress(*comm, maxWaitUs * spyreccl::kNsPerUs);
      algorithms::progress(*comm);
    }
    if (pending != nullptr) *pending = static_cast<int>(comm->pendingP2P().size());
  });
}

spyrecclResult_t spyrecclSetBlockingHook(spyrecclBlockingHook_t hook, void* arg) {
  spyreccl::transport::BlockingHook& h = spyreccl::transport::blockingHook();
  h.fn = hook;
  h.arg = arg;
  return spyrecclSuccess;
}

spyrecclResult_t spyrecclSetThreadYield(int64_t yieldNs) {
  const char* api = "spyrecclSetThreadYield";
  return guarded(nullptr, api, [&](bool&) {
    SPYRECCL_CHECK_ARG(yieldNs >= -1, api,
                       "argument 'yieldNs' = %lld must be >= 0 (ns), or -1 for the "
                       "communicators' own",
                       static_cast<long long>(yieldNs));
    spyreccl::transport::threadYieldNs() = yieldNs;
  });
}

spyrecclResult_t spyrecclCommWakePoll(spyrecclComm_t comm) {
  const char* api = "spyrecclCommWakePoll";
  // No guarded(comm, ...): it may run concurrently with any call on `comm`, so it must not
  // touch the communicator's last error (errors go to the calling thread).
  return guarded(nullptr, api, [&](bool&) {
    checkComm(comm, api);
    algorithms::wakeProgress(*comm);
  });
}

spyrecclResult_t spyrecclGroupStart(void) {
  return guarded(nullptr, "spyrecclGroupStart", [&](bool&) { ++algorithms::threadGroup().depth; });
}

spyrecclResult_t spyrecclGroupEnd(void) {
  return guarded(nullptr, "spyrecclGroupEnd", [&](bool&) {
    algorithms::GroupState& group = algorithms::threadGroup();
    if (group.depth == 0) {
      SPYRECCL_THROW(spyrecclInvalidUsage,
                     "spyrecclGroupEnd: no matching spyrecclGroupStart on this thread");
    }
    if (--group.depth > 0) return;  // only the outermost End executes
    std::vector<algorithms::P2POp> ops;
    ops.swap(group.ops);
    for (const algorithms::P2POp& op : ops) op.comm->ensureUsable("spyrecclGroupEnd");
    algorithms::runP2P(ops);
  });
}

spyrecclResult_t spyrecclMemAlloc(void** ptr, size_t size) {
  const char* api = "spyrecclMemAlloc";
  return guarded(nullptr, api, [&](bool&) {
    SPYRECCL_CHECK_ARG(ptr != nullptr, api, "argument 'ptr' is NULL");
    *ptr = nullptr;
    spyreccl::memory::Arena* arena = spyreccl::memory::Arena::instance();
    if (arena == nullptr) {
      SPYRECCL_THROW(spyrecclSystemError,
                     "%s: the shareable memory arena cannot be created (memfd_create or the "
                     "address-space reservation failed)",
                     api);
    }
    *ptr = arena->allocate(size);
    if (*ptr == nullptr) {
      SPYRECCL_THROW(spyrecclSystemError,
                     "%s: cannot allocate %zu bytes: the memory arena (%zu bytes, %zu in use) is "
                     "exhausted",
                     api, size, arena->size(), arena->bytesInUse());
    }
  });
}

spyrecclResult_t spyrecclMemFree(void* ptr) {
  const char* api = "spyrecclMemFree";
  return guarded(nullptr, api, [&](bool&) {
    if (ptr == nullptr) return;
    spyreccl::memory::Arena* arena = spyreccl::memory::Arena::existing();
    SPYRECCL_CHECK_ARG(arena != nullptr && arena->release(ptr), api,
                       "argument 'ptr' = %p is not a block returned by spyrecclMemAlloc (or it "
                       "was freed already)",
                       ptr);
  });
}

spyrecclResult_t spyrecclMemTrim(size_t* released) {
  const char* api = "spyrecclMemTrim";
  return guarded(nullptr, api, [&](bool&) {
    spyreccl::memory::Arena* arena = spyreccl::memory::Arena::existing();
    const size_t punched = arena != nullptr ? arena->trim() : 0;
    if (released != nullptr) *released = punched;
  });
}

}  // extern "C"

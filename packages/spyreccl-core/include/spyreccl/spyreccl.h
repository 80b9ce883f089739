/*
 * spyreccl.h — the stable C API of the spyreccl collective-communication library.
 *
 * spyreccl moves and reduces host buffers between the ranks (processes) of one node
 * through POSIX shared memory. The API is deliberately shaped like NCCL's nccl.h so that
 * a vendor implementation for real Spyre devices can be dropped in behind the same
 * symbols without touching the layers above (the torch c10d backend only speaks this API).
 *
 * General rules (they hold for every function below unless its comment says otherwise):
 *  - Every function returns a spyrecclResult_t (except the few that return a string);
 *    no C++ exception ever crosses this boundary. On failure, a human readable message
 *    that names the operation, the offending argument and what was expected is recorded
 *    and returned by spyrecclGetLastError:
 *      - on the communicator, for every function that takes one and got a non-NULL
 *        comm (collectives, point-to-point, and also the queries and setters such as
 *        spyrecclCommCount, spyrecclCommSetTimeout, spyrecclCommDumpState);
 *      - in the calling thread's slot, read with spyrecclGetLastError(NULL), for the
 *        functions without a communicator (spyrecclGetVersion, spyrecclGetUniqueId,
 *        spyrecclCommInitRank, spyrecclGroupEnd, ...) and for any call given comm == NULL.
 *    A group's failure (spyrecclGroupEnd) is recorded in both places.
 *  - Buffers are host memory, addressed as (pointer, element count, data type). Counts are
 *    in elements, never bytes. A count of 0 is valid for every operation (it still
 *    synchronises the ranks and checks that all of them called the same collective;
 *    a small broadcast does neither on its root, see below).
 *  - Collectives are blocking: they return when this rank's part of the operation is
 *    complete (its output buffer is final and its input buffer may be reused).
 *  - Every rank of a communicator must call the same collectives in the same order with
 *    matching (operation, data type, count, reduce op, root). A mismatch is detected and
 *    reported on every rank as spyrecclMismatch, naming both sides; the communicator is
 *    then unusable (like after any error other than spyrecclInvalidArgument) and must be
 *    destroyed. One exception to "in the call": a broadcast of at most 256 bytes is
 *    one-way (SPYRECCL_EAGER_BROADCAST_MAX_BYTES; 0 turns it off). Its root returns once
 *    the data is posted, before any receiver checked it, so a rank that cannot see such a
 *    mismatch in the call fails at its next collective that waits for every rank, as
 *    spyrecclMismatch, or spyrecclRemoteError naming the receiver that saw it.
 *  - Every wait is bounded: by the communicator's timeout (spyrecclTimeout), by
 *    spyrecclCommAbort (spyrecclAborted) and by the death or abort of a peer
 *    (spyrecclRemoteError, reported within a fraction of a second of the death).
 *  - A peer's failure is blamed only for data the peer did not deliver. Collectives run
 *    as a sequence of synchronisation steps; in each step every rank publishes its part
 *    and then waits for the parts of the others. A peer that published its part of a step
 *    and then failed (aborted, timed out, died or destroyed its communicator) has still
 *    delivered that step. Hence a rank that arrives late to a collective whose peers had
 *    already posted their data and then failed:
 *      - completes that collective, successfully and with correct results, if every step
 *        it needs was published before the peers failed (today: every collective that
 *        fits in one step, such as a barrier, or an allreduce/reduce of at most
 *        SPYRECCL_ALLREDUCE_ONESHOT_MAX bytes, capped at the chunk size);
 *      - otherwise fails it with spyrecclRemoteError at the first step a failed peer
 *        never published; it never gets success with incomplete or stale data;
 *      - either way, fails its next operation that needs a failed peer with
 *        spyrecclRemoteError promptly (within a fraction of a second), not after the
 *        timeout.
 *    Likewise a receive completes if the sender had posted the whole message before it
 *    failed.
 *  - Thread-safety: a communicator may be used by one thread at a time for
 *    communication (collectives, point-to-point, split, destroy). Different communicators
 *    may be used concurrently from different threads. spyrecclGetVersion,
 *    spyrecclGetErrorString, spyrecclGetDataTypeName, spyrecclGetDataTypeSize,
 *    spyrecclGetUniqueId,
 *    spyrecclCommAbort and the queries and setters (spyrecclCommCount,
 *    spyrecclCommUserRank, spyrecclCommSetTimeout, spyrecclCommGetAsyncError,
 *    spyrecclCommDumpState, spyrecclRedOpCreatePreMulSum, spyrecclRedOpDestroy) are safe
 *    to call from any thread at any time, also while another thread communicates on the
 *    same communicator. Each function's comment states its own rule.
 */
#ifndef SPYRECCL_SPYRECCL_H_
#define SPYRECCL_SPYRECCL_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#error "spyreccl supports POSIX systems only"
#endif

#define SPYRECCL_API __attribute__((visibility("default")))

#define SPYRECCL_MAJOR 0
#define SPYRECCL_MINOR 1
#define SPYRECCL_PATCH 0
/* Version code as returned by spyrecclGetVersion: MAJOR*10000 + MINOR*100 + PATCH. */
#define SPYRECCL_VERSION_CODE (SPYRECCL_MAJOR * 10000 + SPYRECCL_MINOR * 100 + SPYRECCL_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------ */
/* Result codes                                                                          */
/* ------------------------------------------------------------------------------------ */

typedef enum {
  spyrecclSuccess = 0,
  spyrecclSystemError = 1,     /* an OS call failed (shm_open, mmap, ...); errno text in message */
  spyrecclInternalError = 2,   /* a bug in spyreccl: please report it */
  spyrecclInvalidArgument = 3, /* bad pointer/count/dtype/op/root/peer; nothing was communicated,
                                  the communicator stays usable */
  spyrecclInvalidUsage = 4, /* call out of order: destroyed/erroneous communicator, bad id, ... */
  spyrecclRemoteError = 5,  /* a peer died or aborted while this rank waited for it */
  spyrecclTimeout = 6,      /* a wait exceeded the communicator's timeout */
  spyrecclAborted = 7,      /* spyrecclCommAbort was called on this communicator */
  spyrecclMismatch = 8,     /* ranks called different collectives / arguments */
  spyrecclUnsupported = 9,  /* valid request this implementation does not support
                               (e.g. ranks on different hosts) */
  spyrecclNumResults = 10
} spyrecclResult_t;

/* ------------------------------------------------------------------------------------ */
/* Data types and reduction operations                                                   */
/* ------------------------------------------------------------------------------------ */

/* Numbering follows NCCL for the types both libraries have. */
typedef enum {
  spyrecclInt8 = 0,
  spyrecclUint8 = 1,
  spyrecclInt32 = 2,
  spyrecclUint32 = 3,
  spyrecclInt64 = 4,
  spyrecclUint64 = 5,
  spyrecclFloat16 = 6,
  spyrecclFloat32 = 7,
  spyrecclFloat64 = 8,
  spyrecclBfloat16 = 9,
  spyrecclFloat8e4m3 = 10, /* float8_e4m3fn: no infinities, 0x7f/0xff are NaN */
  spyrecclFloat8e5m2 = 11,
  spyrecclInt16 = 12,
  spyrecclBool = 13, /* one byte, 0 or 1 */
  spyrecclNumTypes = 14
} spyrecclDataType_t;

/*
 * Reduction operations. Semantics per type:
 *  - float16/bfloat16/float8 are reduced with float32 accumulation and rounded once
 *    (round-to-nearest-even) at the end; every rank receives bitwise identical results.
 *  - AVG on floating types: sum / nranks. AVG on integer types: the exact sum divided by
 *    nranks with truncation toward zero (C integer division, the rule NCCL uses).
 *    AVG on bool is spyrecclInvalidArgument.
 *  - BAND/BOR/BXOR: integer and bool types only.
 *  - bool: SUM and MAX are logical OR, PROD and MIN are logical AND.
 *  - Integer SUM/PROD wrap around (two's complement) like the C++ operators on unsigned.
 *  - PreMulSum: see spyrecclRedOpCreatePreMulSum.
 */
typedef enum {
  spyrecclSum = 0,
  spyrecclProd = 1,
  spyrecclMax = 2,
  spyrecclMin = 3,
  spyrecclAvg = 4,
  spyrecclBand = 5,
  spyrecclBor = 6,
  spyrecclBxor = 7,
  spyrecclNumOps = 8,
  /* Values >= spyrecclNumOps are handles returned by spyrecclRedOpCreatePreMulSum. */
  spyrecclMaxRedOp = 0x7fffffff
} spyrecclRedOp_t;

/* ------------------------------------------------------------------------------------ */
/* Unique id and configuration                                                           */
/* ------------------------------------------------------------------------------------ */

#define SPYRECCL_UNIQUE_ID_BYTES 128
/*
 * Plain-old-data token that names one communicator-to-be. Rank 0 creates it with
 * spyrecclGetUniqueId and hands it to the other ranks over any channel (a file, a
 * socket, torch's Store). It carries a random per-job nonce, the creating host and a
 * format version; it is valid for exactly one spyrecclCommInitRank round.
 */
typedef struct {
  char internal[SPYRECCL_UNIQUE_ID_BYTES];
} spyrecclUniqueId;

#define SPYRECCL_CONFIG_MAGIC 0x5350434cu /* "SPCL" */
#define SPYRECCL_CONFIG_VERSION 2         /* 2 added yieldNs */

/*
 * Versioned communicator configuration. Always start from SPYRECCL_CONFIG_INITIALIZER
 * so that fields added by a later version get their defaults; the library reads only
 * the fields covered by `size`.
 */
typedef struct {
  size_t size;          /* sizeof(spyrecclConfig_t) of the caller's header */
  unsigned int magic;   /* SPYRECCL_CONFIG_MAGIC */
  unsigned int version; /* SPYRECCL_CONFIG_VERSION */
  int64_t timeoutMs;    /* bound on every wait, in ms; default 1800000 (30 min); must be > 0 */
  size_t chunkBytes;    /* staging bytes per rank per pipeline slot; 0 = default (env
                           SPYRECCL_CHUNK_BYTES or 1 MiB); rounded to 4 KiB, min 16 KiB */
  size_t p2pChunkBytes; /* staging bytes per ordered pair for send/recv; 0 = default
                           (env SPYRECCL_P2P_CHUNK_BYTES or 256 KiB) */
  const char* name;     /* optional label used in error messages and dumps (copied) */
  int64_t yieldNs;      /* (version 2) how long a wait that outlasted its spin keeps the CPU
                           with sched_yield before it sleeps on a futex, in ns; -1 = default
                           (env SPYRECCL_YIELD_NS or 2 ms), 0 = sleep at once. Yielding
                           hands a shared CPU straight to a peer that is about to arrive;
                           shorten it where waits are long, e.g. a communicator whose ranks
                           wait for transfers between hosts, so that waiting ranks do not
                           keep CPUs busy that those transfers need. */
} spyrecclConfig_t;

#define SPYRECCL_CONFIG_INITIALIZER \
  {sizeof(spyrecclConfig_t),        \
   SPYRECCL_CONFIG_MAGIC,           \
   SPYRECCL_CONFIG_VERSION,         \
   (int64_t)1800000,                \
   (size_t)0,                       \
   (size_t)0,                       \
   (const char*)0,                  \
   (int64_t)-1}

/* Opaque communicator handle. */
typedef struct spyrecclComm* spyrecclComm_t;

#define SPYRECCL_SPLIT_NOCOLOR (-1)

/* ------------------------------------------------------------------------------------ */
/* Library information and errors                                                        */
/* ------------------------------------------------------------------------------------ */

/*
 * spyrecclGetVersion: stores SPYRECCL_VERSION_CODE of the loaded library in *version.
 * Thread-safe. Errors: spyrecclInvalidArgument if version is NULL (message on the calling
 * thread).
 */
SPYRECCL_API spyrecclResult_t spyrecclGetVersion(int* version);

/*
 * spyrecclGetErrorString: a static, never-NULL description of a result code
 * ("spyrecclTimeout: a wait exceeded the communicator timeout"); a value that is not a
 * spyrecclResult_t gives "unknown spyrecclResult_t value". Thread-safe; cannot fail.
 */
SPYRECCL_API const char* spyrecclGetErrorString(spyrecclResult_t result);

/*
 * spyrecclGetLastError: the detailed message of the last failed call on `comm`, or, when
 * comm is NULL, of the last failed call of the calling thread that had no communicator
 * (see the general rules above for which calls record where). Never NULL; the empty
 * string when there was no failure. A success does not clear it.
 * Thread-safety: safe from any thread. The returned pointer stays valid until the next
 * failing call on the same communicator (from any thread) or, for comm == NULL, the next
 * failing call without a communicator on the same thread, and until spyrecclCommDestroy:
 * copy the message before another thread may fail a call on the same communicator.
 * Cannot fail.
 */
SPYRECCL_API const char* spyrecclGetLastError(spyrecclComm_t comm);

/*
 * spyrecclGetDataTypeName: the name of `datatype`, spelled like the corresponding torch
 * dtype without its "torch." prefix: "int8", "uint8", "int16", "int32", "uint32",
 * "int64", "uint64", "float16", "float32", "float64", "bfloat16", "float8_e4m3fn",
 * "float8_e5m2", "bool". These are also the spellings used in every error message and
 * state dump of the library. Returns NULL for a value outside [0, spyrecclNumTypes), so
 * callers can tell an invalid value from a name (do not pass the result to printf's %s
 * unchecked). The string is static. Thread-safe; records no error.
 */
SPYRECCL_API const char* spyrecclGetDataTypeName(spyrecclDataType_t datatype);

/*
 * spyrecclGetDataTypeSize: bytes per element of `datatype` (1, 2, 4 or 8), or 0 for a
 * value outside [0, spyrecclNumTypes). Thread-safe; records no error.
 */
SPYRECCL_API size_t spyrecclGetDataTypeSize(spyrecclDataType_t datatype);

/* ------------------------------------------------------------------------------------ */
/* Communicator lifecycle                                                                */
/* ------------------------------------------------------------------------------------ */

/*
 * spyrecclGetUniqueId: fills *uniqueId with a fresh id (random nonce from the kernel's
 * CSPRNG, hostname, format version). Called once, by rank 0, per communicator.
 * Thread-safe. Errors (message on the calling thread): spyrecclInvalidArgument if uniqueId
 * is NULL; spyrecclSystemError if getrandom or gethostname fails.
 */
SPYRECCL_API spyrecclResult_t spyrecclGetUniqueId(spyrecclUniqueId* uniqueId);

/*
 * spyrecclCommInitRank: collective over `nranks` processes of one host that all pass the
 * same `id`; each passes its distinct `rank` in [0, nranks). Rank 0 creates the shared
 * memory segment (mode 0600, O_EXCL, unguessable name from the id's nonce); the others
 * attach, validate it (magic, version, nonce, size) and the segment is unlinked as soon as
 * every rank has attached, so nothing is left in /dev/shm even if a process is killed.
 * Blocks until all ranks have joined or config->timeoutMs expires (spyrecclTimeout). A
 * rank on a different host than rank 0 fails with spyrecclUnsupported. `config` may be
 * NULL for the defaults. On failure *comm is set to NULL.
 * Thread-safety: may be called concurrently from different threads for different ids.
 * Errors (message on the calling thread): spyrecclInvalidArgument (comm NULL, nranks
 * outside [1, 4096], rank outside [0, nranks), malformed config), spyrecclInvalidUsage
 * (not a unique id, id already used, rank joined twice, nranks or chunk sizes that differ
 * from rank 0's), spyrecclUnsupported (another host), spyrecclTimeout (ranks missing
 * after config->timeoutMs, named in the message), spyrecclSystemError (shm/mmap failure).
 */
SPYRECCL_API spyrecclResult_t spyrecclCommInitRank(spyrecclComm_t* comm, int nranks,
                                                   spyrecclUniqueId id, int rank,
                                                   const spyrecclConfig_t* config);

/*
 * spyrecclCommSplit: collective over every rank of `comm`. Ranks passing the same
 * `color` form a new communicator, ordered by (`key`, old rank). A rank passing
 * SPYRECCL_SPLIT_NOCOLOR gets *newcomm = NULL. `config` NULL inherits comm's settings
 * (timeout, chunk sizes, name). Like any collective it must be called by all ranks of
 * `comm` in the same order, by one thread at a time per communicator.
 * Errors (message on comm): spyrecclInvalidArgument (comm or newcomm NULL, color < 0 other
 * than SPYRECCL_SPLIT_NOCOLOR, malformed config; nothing communicated), spyrecclInvalidUsage
 * (inside a group, or comm already failed), and any error of a collective (the parent is
 * then failed). A failure while creating the child after the exchange sets *newcomm = NULL
 * and leaves the parent usable.
 */
SPYRECCL_API spyrecclResult_t spyrecclCommSplit(spyrecclComm_t comm, int color, int key,
                                                spyrecclComm_t* newcomm,
                                                const spyrecclConfig_t* config);

/*
 * spyrecclCommDestroy: local (not collective) release of all resources of `comm`:
 * mappings, descriptors, memory. Peers that later wait for this rank get
 * spyrecclRemoteError ("rank r left the communicator"). Must not race with another
 * thread still using `comm`: call spyrecclCommAbort first to unblock it, then join it.
 * Operations on `comm` queued in the calling thread's open group are dropped.
 * Destroying NULL is a no-op. Always returns spyrecclSuccess.
 */
SPYRECCL_API spyrecclResult_t spyrecclCommDestroy(spyrecclComm_t comm);

/*
 * spyrecclCommAbort: marks `comm` aborted and wakes every wait on it. Safe to call from
 * any thread (also while another thread is blocked inside a collective on `comm`, which
 * then returns spyrecclAborted) and from a signal-free context only. Peers blocked on
 * this rank get spyrecclRemoteError. Does not free memory: call spyrecclCommDestroy once
 * no thread uses the communicator any more. Idempotent. A peer's collective that already
 * received everything it needs from this rank may still complete (see the general rules).
 * Errors: spyrecclInvalidArgument if comm is NULL (message on the calling thread).
 */
SPYRECCL_API spyrecclResult_t spyrecclCommAbort(spyrecclComm_t comm);

/*
 * spyrecclCommCount / spyrecclCommUserRank: store the size / this process's rank of `comm`
 * in *count / *rank. Thread-safe (also while another thread communicates on comm); they
 * work on a failed or aborted communicator too. Errors: spyrecclInvalidArgument if comm
 * is NULL (message on the calling thread) or if the output pointer is NULL (message on
 * comm, which stays usable).
 */
SPYRECCL_API spyrecclResult_t spyrecclCommCount(const spyrecclComm_t comm, int* count);
SPYRECCL_API spyrecclResult_t spyrecclCommUserRank(const spyrecclComm_t comm, int* rank);

/*
 * spyrecclCommSetTimeout: changes the bound on every subsequent wait (ms, > 0).
 * Thread-safe; a wait already in progress keeps its deadline. Errors:
 * spyrecclInvalidArgument if comm is NULL (message on the calling thread) or
 * timeoutMs <= 0 (message on comm; the timeout is unchanged).
 */
SPYRECCL_API spyrecclResult_t spyrecclCommSetTimeout(spyrecclComm_t comm, int64_t timeoutMs);

/*
 * spyrecclCommGetAsyncError: stores in *asyncError spyrecclSuccess while `comm` is
 * healthy, otherwise the code of the error that broke it (spyrecclAborted after
 * spyrecclCommAbort); a peer death is noticed here only once a wait observes it.
 * Invalid arguments of earlier calls never break a communicator. Thread-safe. Errors:
 * spyrecclInvalidArgument if comm is NULL (message on the calling thread) or asyncError is
 * NULL (message on comm).
 */
SPYRECCL_API spyrecclResult_t spyrecclCommGetAsyncError(spyrecclComm_t comm,
                                                        spyrecclResult_t* asyncError);

/*
 * spyrecclCommDumpState: writes a NUL-terminated, human readable snapshot of `comm`
 * (this rank's recent collectives with sequence numbers, sizes and states, and what
 * every peer last announced) into buf[0..len). In the spirit of NCCL's flight recorder;
 * the same text is appended to timeout/peer-failure messages and written to
 * $SPYRECCL_DUMP_DIR/spyreccl-<name>-rank<r>.txt on such failures when that variable is
 * set. Thread-safe (also while another thread is blocked in a collective on comm: that is
 * what it is for). Truncates silently when len is too small. Errors:
 * spyrecclInvalidArgument if comm is NULL (message on the calling thread) or buf is NULL
 * or len is 0 (message on comm).
 */
SPYRECCL_API spyrecclResult_t spyrecclCommDumpState(spyrecclComm_t comm, char* buf, size_t len);

/*
 * spyrecclRedOpCreatePreMulSum: creates a reduction handle that computes
 * sum_r(scalar * x_r) (the scalar is applied in the accumulation type: float32 for
 * 16/8-bit floats, the type itself otherwise; integer types are rejected). Local call;
 * the handle is valid on `comm` only, with `datatype` only, and every rank must create its
 * handles in the same order. At most 1024 live handles per communicator.
 * Thread-safe (the handle table has its own lock). Errors (message on comm, which stays
 * usable; on the calling thread if comm is NULL): spyrecclInvalidArgument (comm or op
 * NULL, invalid or non-floating datatype), spyrecclInvalidUsage (1024 handles are live).
 */
SPYRECCL_API spyrecclResult_t spyrecclRedOpCreatePreMulSum(spyrecclRedOp_t* op, double scalar,
                                                           spyrecclDataType_t datatype,
                                                           spyrecclComm_t comm);
/*
 * spyrecclRedOpDestroy: releases a handle of spyrecclRedOpCreatePreMulSum; later use of
 * the value is spyrecclInvalidArgument (until a new handle reuses it). Local call.
 * Thread-safe; a collective that already started with `op` is not affected.
 * Errors: spyrecclInvalidArgument if comm is NULL (message on the calling thread) or op is
 * a built-in op or not a live handle of comm (message on comm).
 */
SPYRECCL_API spyrecclResult_t spyrecclRedOpDestroy(spyrecclRedOp_t op, spyrecclComm_t comm);

/* ------------------------------------------------------------------------------------ */
/* Collectives (blocking; see the general rules at the top)                              */
/* ------------------------------------------------------------------------------------ */
/*
 * Common to every collective below:
 *  - Thread-safety: one thread at a time per communicator (see the general rules).
 *  - Errors, all with the message on comm (on the calling thread if comm is NULL):
 *    spyrecclInvalidArgument, before anything is communicated (comm stays usable), for
 *    comm NULL, an invalid datatype, an invalid op or handle, or an op the datatype does
 *    not support (band on float32, avg on bool, a handle created for another datatype),
 *    a root out of range, a NULL buffer that must carry data, counts whose byte size
 *    overflows, buffers that overlap without being exactly the in-place layout;
 *    spyrecclInvalidUsage inside spyrecclGroupStart/End (comm stays usable) or on a failed
 *    communicator; spyrecclMismatch, spyrecclTimeout, spyrecclRemoteError,
 *    spyrecclAborted, spyrecclSystemError during communication (comm is then failed).
 */

/*
 * spyrecclAllReduce: recvbuff[i] = op over ranks of sendbuff[i], i < count, on every rank.
 * In place when sendbuff == recvbuff. Buffers must not otherwise overlap.
 */
SPYRECCL_API spyrecclResult_t spyrecclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                                spyrecclDataType_t datatype, spyrecclRedOp_t op,
                                                spyrecclComm_t comm);

/* spyrecclReduce: like AllReduce but only `root` receives; recvbuff is ignored elsewhere
 * (may be NULL). In place on root when sendbuff == recvbuff. */
SPYRECCL_API spyrecclResult_t spyrecclReduce(const void* sendbuff, void* recvbuff, size_t count,
                                             spyrecclDataType_t datatype, spyrecclRedOp_t op,
                                             int root, spyrecclComm_t comm);

/* spyrecclBroadcast: copies root's sendbuff to every rank's recvbuff. sendbuff is read on
 * root only (NULL allowed elsewhere). In place when sendbuff == recvbuff. Up to 256 bytes
 * (see the mismatch note above) the root returns once its data is copied into the
 * communicator, without waiting for the receivers; it may run up to 256 such calls ahead. */
SPYRECCL_API spyrecclResult_t spyrecclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                                                spyrecclDataType_t datatype, int root,
                                                spyrecclComm_t comm);

/* spyrecclAllGather: recvbuff[r*sendcount + i] = sendbuff_of_rank_r[i]. In place when
 * sendbuff == recvbuff + rank*sendcount (in elements). */
SPYRECCL_API spyrecclResult_t spyrecclAllGather(const void* sendbuff, void* recvbuff,
                                                size_t sendcount, spyrecclDataType_t datatype,
                                                spyrecclComm_t comm);

/* spyrecclReduceScatter: recvbuff[i] = op over ranks r of sendbuff_r[rank*recvcount + i].
 * sendbuff holds nranks*recvcount elements. In place when
 * recvbuff == sendbuff + rank*recvcount. */
SPYRECCL_API spyrecclResult_t spyrecclReduceScatter(const void* sendbuff, void* recvbuff,
                                                    size_t recvcount, spyrecclDataType_t datatype,
                                                    spyrecclRedOp_t op, spyrecclComm_t comm);

/* spyrecclAllToAll: block p of sendbuff (count elements) goes to rank p, where it lands
 * as block `rank` of recvbuff. Not in place. */
SPYRECCL_API spyrecclResult_t spyrecclAllToAll(const void* sendbuff, void* recvbuff, size_t count,
                                               spyrecclDataType_t datatype, spyrecclComm_t comm);

/* spyrecclAllToAllv: sendcounts[p] elements from sendbuff + sdispls[p] go to rank p, which
 * receives them at recvbuff + rdispls[rank] with recvcounts[rank] == this sendcounts[p]
 * (checked: a disagreement is spyrecclMismatch on both ranks). Arrays have nranks entries,
 * all in elements. Not in place. */
SPYRECCL_API spyrecclResult_t spyrecclAllToAllv(const void* sendbuff, const size_t* sendcounts,
                                                const size_t* sdispls, void* recvbuff,
                                                const size_t* recvcounts, const size_t* rdispls,
                                                spyrecclDataType_t datatype, spyrecclComm_t comm);

/* spyrecclGather: root's recvbuff[r*sendcount + i] = sendbuff_r[i]; recvbuff ignored
 * elsewhere. In place on root when sendbuff == recvbuff + root*sendcount. */
SPYRECCL_API spyrecclResult_t spyrecclGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                             spyrecclDataType_t datatype, int root,
                                             spyrecclComm_t comm);

/* spyrecclScatter: recvbuff[i] = root's sendbuff[rank*recvcount + i]; sendbuff read on root
 * only. In place on root when recvbuff == sendbuff + root*recvcount. */
SPYRECCL_API spyrecclResult_t spyrecclScatter(const void* sendbuff, void* recvbuff,
                                              size_t recvcount, spyrecclDataType_t datatype,
                                              int root, spyrecclComm_t comm);

/* spyrecclBarrier: returns once every rank has entered it. */
SPYRECCL_API spyrecclResult_t spyrecclBarrier(spyrecclComm_t comm);

/* ------------------------------------------------------------------------------------ */
/* Point-to-point                                                                        */
/* ------------------------------------------------------------------------------------ */

/*
 * spyrecclSend / spyrecclRecv: messages between an ordered pair of ranks are delivered
 * in FIFO order; a receive must name the same count, datatype and tag as the matching
 * send (otherwise spyrecclMismatch on the receiving rank, and on the sender when it is
 * still transferring). Any size; large messages are pipelined through a bounded staging
 * area, so a blocking send of a large message returns only once the receiver has
 * consumed most of it. To post sends and receives that must progress together (e.g. a
 * ring exchange) wrap them in spyrecclGroupStart/End.
 * Thread-safety: one thread at a time per communicator; inside a group the operation is
 * queued on the calling thread's group.
 * Errors (message on comm): spyrecclInvalidArgument (comm NULL, invalid datatype, peer out
 * of range or == own rank, NULL buffer with count > 0; comm stays usable),
 * spyrecclInvalidUsage (comm already failed), and the communication errors of the
 * collectives (spyrecclMismatch, spyrecclTimeout, spyrecclRemoteError, spyrecclAborted).
 * Inside a group only the argument errors are reported here; the rest by GroupEnd.
 */
SPYRECCL_API spyrecclResult_t spyrecclSend(const void* sendbuff, size_t count,
                                           spyrecclDataType_t datatype, int peer, int tag,
                                           spyrecclComm_t comm);
SPYRECCL_API spyrecclResult_t spyrecclRecv(void* recvbuff, size_t count,
                                           spyrecclDataType_t datatype, int peer, int tag,
                                           spyrecclComm_t comm);

/*
 * spyrecclRecvAnySource: receives the next message with tag `tag` from whichever rank
 * sends first (lowest rank wins a tie); *source receives that rank. Thread-safety: one
 * thread at a time per communicator. Errors (message on comm): as spyrecclRecv, plus
 * spyrecclInvalidArgument for source NULL or a single-rank communicator, and
 * spyrecclInvalidUsage inside a group (comm stays usable).
 */
SPYRECCL_API spyrecclResult_t spyrecclRecvAnySource(void* recvbuff, size_t count,
                                                    spyrecclDataType_t datatype, int tag,
                                                    int* source, spyrecclComm_t comm);

/*
 * Non-blocking point-to-point (MPI_Isend/MPI_Irecv style).
 *
 * spyrecclIsend / spyrecclIrecv: post a send or a receive and return at once; *request
 * identifies it until spyrecclTest reports it done or spyrecclWait returns. Arguments,
 * matching (count, datatype, tag) and FIFO order are those of spyrecclSend/spyrecclRecv:
 * operations on the same (peer, direction) complete in the order they were posted,
 * whether posted by these calls, by the blocking calls or by a group. Buffers must stay
 * valid and untouched (recvbuff unread) until the request is done.
 *
 * Progress: every pending request of a communicator moves whenever any call on it waits or
 * polls: spyrecclTest, spyrecclWait, spyrecclCommPoll, the blocking send/receive and group
 * calls, and the collectives (so a send posted before a collective cannot deadlock against
 * a peer that receives it after that collective). Nothing moves between calls: there is
 * no background thread.
 *
 * Failure: the first error on a communicator (mismatch, a peer's failure, the
 * communicator's timeout counted from each request's posting, spyrecclCommAbort) abandons
 * every request pending on it and marks the communicator failed; each request then reports
 * that error once, through the spyrecclTest or spyrecclWait that releases it.
 *
 * Lifetime: a request is released when spyrecclTest sets *done = 1 or spyrecclWait
 * returns (success or error); the handle is invalid afterwards. spyrecclCommDestroy frees
 * the requests of the communicator that were never released (their handles become
 * invalid; a pending one is abandoned without completing).
 *
 * Thread-safety: one thread at a time per communicator, for these calls and every other
 * call on it, except spyrecclCommWakePoll and spyrecclCommAbort.
 * Errors of spyrecclIsend/Irecv (message on comm): those of spyrecclSend/spyrecclRecv's
 * validation, spyrecclInvalidArgument for request NULL, spyrecclInvalidUsage inside a
 * group or on a failed communicator. Communication errors are reported by the request.
 */
typedef struct spyrecclRequest* spyrecclRequest_t;

SPYRECCL_API spyrecclResult_t spyrecclIsend(const void* sendbuff, size_t count,
                                            spyrecclDataType_t datatype, int peer, int tag,
                                            spyrecclComm_t comm, spyrecclRequest_t* request);
SPYRECCL_API spyrecclResult_t spyrecclIrecv(void* recvbuff, size_t count,
                                            spyrecclDataType_t datatype, int peer, int tag,
                                            spyrecclComm_t comm, spyrecclRequest_t* request);

/*
 * spyrecclTest: progresses the communicator's pending requests once without blocking and
 * sets *done to 1 when `request` is complete (and releases it), else 0. A request that
 * was abandoned reports its error here (with *done = 1: it is released too).
 * spyrecclWait: blocks until `request` is complete, progressing every pending request of
 * its communicator; bounded like every wait (the communicator's timeout, peer failure,
 * spyrecclCommAbort). Releases the request, also on error.
 * Errors (message on the request's communicator): spyrecclInvalidArgument (request or done
 * NULL), the request's communication error.
 */
SPYRECCL_API spyrecclResult_t spyrecclTest(spyrecclRequest_t request, int* done);
SPYRECCL_API spyrecclResult_t spyrecclWait(spyrecclRequest_t request);

/*
 * spyrecclCommPoll: progresses every pending request of comm once; when none could move
 * and maxWaitUs > 0, sleeps until a peer makes one of them movable, spyrecclCommWakePoll
 * is called, or maxWaitUs microseconds passed, and progresses once more. *pending (may be
 * NULL) receives the number of requests still pending. For a progress loop that waits on
 * several requests and on other events at once (c10d's progress thread).
 * Errors (message on comm): spyrecclInvalidArgument (comm NULL, maxWaitUs < 0), and the
 * error that abandoned the pending requests (they report it as well).
 *
 * spyrecclCommWakePoll: makes a spyrecclCommPoll of comm that sleeps (or the next one)
 * return early. Thread-safe: may be called while another thread uses comm. Errors
 * (message on the calling thread): spyrecclInvalidArgument (comm NULL).
 */
SPYRECCL_API spyrecclResult_t spyrecclCommPoll(spyrecclComm_t comm, int64_t maxWaitUs,
                                               int* pending);
SPYRECCL_API spyrecclResult_t spyrecclCommWakePoll(spyrecclComm_t comm);

/*
 * spyrecclSetBlockingHook: arms a one-shot hook on the calling thread. The next wait of a
 * spyreccl call made by this thread that outlasts the initial spin (about 2 us; at once
 * when the communicator's ranks oversubscribe the CPUs and waits do not spin) first calls
 * hook(arg), from inside that call and on this thread, and disarms the hook. hook == NULL
 * disarms it. Calls that never wait that long do not call it.
 *
 * Meant for language bindings that hold an interpreter lock (Python's GIL) while they call
 * spyreccl: they may keep the lock over calls that complete within the spin, and release it
 * in the hook, only when the call is about to block for longer (and take it back after the
 * call returned). Work that is not waiting (copies, reductions) never fires the hook, so
 * such a binding should arm it only for small messages. The hook must not call spyreccl
 * functions, throw or longjmp. Thread-local state only: thread-safe; cannot fail.
 */
typedef void (*spyrecclBlockingHook_t)(void* arg);
SPYRECCL_API spyrecclResult_t spyrecclSetBlockingHook(spyrecclBlockingHook_t hook, void* arg);

/*
 * spyrecclSetThreadYield: how long the waits of spyreccl calls made by the calling thread
 * keep the CPU with sched_yield before they sleep on a futex, in ns, in place of their
 * communicator's yieldNs (spyrecclConfig_t); 0 sleeps right after the spin, -1 restores the
 * communicators' own. For a caller that knows a particular call will wait long (e.g. for a
 * peer that waits for a transfer between hosts) while the communicator's other waits are
 * short rendezvous, where yielding hands a shared CPU to the peer about to arrive. Waits
 * driven by other threads (a progress thread, spyrecclGroupEnd's workers) are not affected.
 * Thread-local state only: thread-safe. Errors: spyrecclInvalidArgument (yieldNs < -1).
 */
SPYRECCL_API spyrecclResult_t spyrecclSetThreadYield(int64_t yieldNs);

/*
 * spyrecclGroupStart / spyrecclGroupEnd: between them, spyrecclSend and spyrecclRecv on
 * the calling thread only validate and enqueue; spyrecclGroupEnd progresses all enqueued
 * operations concurrently and returns when all are complete (or the first error; the
 * remaining operations are then abandoned and their communicators marked failed).
 * Groups nest (only the outermost End executes). Collectives are not allowed inside a
 * group (spyrecclInvalidUsage). Per-thread state: thread-safe.
 * Errors: spyrecclGroupStart cannot fail. spyrecclGroupEnd: spyrecclInvalidUsage without
 * a matching spyrecclGroupStart on this thread or when a queued operation's communicator
 * already failed, and the communication errors of its operations. Its message is
 * recorded on the calling thread (spyrecclGetLastError(NULL)) and, for an error during
 * communication, also on every communicator the group marked failed.
 */
SPYRECCL_API spyrecclResult_t spyrecclGroupStart(void);
SPYRECCL_API spyrecclResult_t spyrecclGroupEnd(void);

/*
 * spyrecclMemAlloc / spyrecclMemFree: memory that the ranks of a node can read from each
 * other directly (NCCL's ncclMemAlloc, for host memory).
 *
 * Collectives whose buffers come from here move every byte between processes once: each
 * rank reads the peers' data in place instead of staging it through the communicator's
 * shared segment (a copy in, a copy out). Collectives on any other memory work exactly the
 * same, only staged; a collective takes the direct path when every buffer it reads from a
 * peer is in that peer's arena and the message is at least SPYRECCL_DIRECT_MIN_BYTES
 * (default 256 KiB; SPYRECCL_DIRECT=0 disables the path).
 *
 * The memory lives in a per-process arena: one sparse memfd (pages exist once touched)
 * reserved at the physical memory size, which peers map read-only on the first large
 * collective of a communicator — this needs the same permission as ptrace-reading the
 * peer (same user; relaxed Yama/seccomp policies); without it every collective is staged.
 * Blocks are page aligned (4096 bytes). After fork() the child's arena is a private
 * copy-on-write mapping at the same addresses (nothing the child writes reaches the
 * parent; pages the child has not written yet still show the parent's later writes); the
 * child's collectives on it are staged.
 *
 * spyrecclMemAlloc: *ptr receives a block of at least `size` bytes (size 0 gives a valid
 * one-page block). Errors: spyrecclInvalidArgument (ptr NULL), spyrecclSystemError (the
 * arena cannot be created: no memfd support, or the reservation was refused; or it is
 * exhausted). spyrecclMemFree: releases a block from spyrecclMemAlloc (ptr NULL is a
 * no-op); spyrecclInvalidArgument when ptr is not the start of a live block. Messages go
 * to the calling thread's last error. Thread-safe.
 *
 * Freed blocks keep their pages for reuse, up to SPYRECCL_ARENA_RETAIN_BYTES of freed
 * memory per process (default an eighth of physical memory, at most 1 GiB; read when the
 * arena is created); beyond it their pages go back to the system. A page that went back
 * costs a page fault and a zeroed page when it is touched again.
 *
 * spyrecclMemTrim: returns the pages of every freed block to the system (a caching
 * allocator's "empty cache"); *released (may be NULL) receives the bytes of freed address
 * space it covered. Success with 0 when no arena exists or in a forked child (its pages
 * are its parent's). Thread-safe.
 */
SPYRECCL_API spyrecclResult_t spyrecclMemAlloc(void** ptr, size_t size);
SPYRECCL_API spyrecclResult_t spyrecclMemFree(void* ptr);
SPYRECCL_API spyrecclResult_t spyrecclMemTrim(size_t* released);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SPYRECCL_SPYRECCL_H_ */

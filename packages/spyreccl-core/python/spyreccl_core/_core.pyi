# Type stub of the compiled module spyreccl_core._core (src/python/*.cc). Keep in sync.
import builtins
import enum
from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import ClassVar, Literal

from typing_extensions import Buffer, Self

__version__: str
UNIQUE_ID_BYTES: int

_Timeout = timedelta | float

class DataType(enum.IntEnum):
    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8_E4M3 = 10
    FLOAT8_E5M2 = 11
    INT16 = 12
    BOOL = 13

class ReduceOp(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8

class Result(enum.IntEnum):
    SUCCESS = 0
    SYSTEM_ERROR = 1
    INTERNAL_ERROR = 2
    INVALID_ARGUMENT = 3
    INVALID_USAGE = 4
    REMOTE_ERROR = 5
    TIMEOUT = 6
    ABORTED = 7
    MISMATCH = 8
    UNSUPPORTED = 9

class SpyrecclError(RuntimeError):
    code: Result | None

class SystemError_(SpyrecclError, OSError):
    code: Result

class InternalError(SpyrecclError):
    code: Result

class InvalidArgumentError(SpyrecclError, ValueError):
    code: Result

class InvalidUsageError(SpyrecclError):
    code: Result

class RemoteError(SpyrecclError):
    code: Result

class TimeoutError(SpyrecclError, builtins.TimeoutError):
    code: Result

class AbortedError(SpyrecclError):
    code: Result

class MismatchError(SpyrecclError):
    code: Result

class UnsupportedError(SpyrecclError):
    code: Result

def library_version() -> str: ...
def error_string(result: Result) -> str: ...
def set_thread_yield(ns: int) -> None: ...

class UniqueId:
    SIZE: ClassVar[int]
    def __init__(self) -> None: ...
    @staticmethod
    def from_bytes(data: bytes) -> UniqueId: ...
    def to_bytes(self) -> bytes: ...
    def __bytes__(self) -> bytes: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __getstate__(self) -> bytes: ...
    def __setstate__(self, state: bytes) -> None: ...

class Group:
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]: ...

class SharedBuffer:
    @property
    def nbytes(self) -> int: ...
    def __init__(self, nbytes: int) -> None: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class Request:
    def test(self) -> bool: ...
    def wait(self) -> None: ...
    @property
    def done(self) -> bool: ...

def group() -> Group: ...
def group_start() -> None: ...
def group_end() -> None: ...

class Communicator:
    def __init__(
        self,
        rank: int,
        size: int,
        unique_id: UniqueId,
        *,
        timeout: _Timeout | None = None,
        chunk_bytes: int = 0,
        p2p_chunk_bytes: int = 0,
        name: str | None = None,
        yield_ns: int | None = None,
    ) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def split(self, color: int | None, key: int | None = None) -> Communicator | None: ...
    def abort(self) -> None: ...
    def destroy(self) -> None: ...
    def close(self) -> None: ...
    def set_timeout(self, timeout: _Timeout) -> None: ...
    def dump_state(self) -> str: ...
    def async_error(self) -> Result: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]: ...
    # Collectives. Buffers: numpy arrays or any C-contiguous buffer; `dtype` reinterprets an
    # integer view of the same width (uint16 -> BFLOAT16, uint8 -> FLOAT8_*).
    def all_reduce(
        self,
        send: Buffer,
        recv: Buffer | None = None,
        op: ReduceOp = ReduceOp.SUM,
        *,
        scalar: float | None = None,
        dtype: DataType | None = None,
    ) -> None: ...
    def reduce(
        self,
        send: Buffer,
        recv: Buffer | None,
        root: int,
        op: ReduceOp = ReduceOp.SUM,
        *,
        scalar: float | None = None,
        dtype: DataType | None = None,
    ) -> None: ...
    def broadcast(self, buf: Buffer, root: int, *, dtype: DataType | None = None) -> None: ...
    def all_gather(self, send: Buffer, recv: Buffer, *, dtype: DataType | None = None) -> None: ...
    def reduce_scatter(
        self,
        send: Buffer,
        recv: Buffer,
        op: ReduceOp = ReduceOp.SUM,
        *,
        scalar: float | None = None,
        dtype: DataType | None = None,
    ) -> None: ...
    def all_to_all(self, send: Buffer, recv: Buffer, *, dtype: DataType | None = None) -> None: ...
    def all_to_all_v(
        self,
        send: Buffer,
        send_counts: Sequence[int],
        recv: Buffer,
        recv_counts: Sequence[int],
        send_displs: Sequence[int] | None = None,
        recv_displs: Sequence[int] | None = None,
        *,
        dtype: DataType | None = None,
    ) -> None: ...
    def gather(
        self, send: Buffer, recv: Buffer | None, root: int, *, dtype: DataType | None = None
    ) -> None: ...
    def scatter(
        self, send: Buffer | None, recv: Buffer, root: int, *, dtype: DataType | None = None
    ) -> None: ...
    def barrier(self) -> None: ...
    # Point-to-point
    def send(
        self, buf: Buffer, peer: int, tag: int = 0, *, dtype: DataType | None = None
    ) -> None: ...
    def recv(
        self, buf: Buffer, peer: int, tag: int = 0, *, dtype: DataType | None = None
    ) -> None: ...
    def isend(
        self, buf: Buffer, peer: int, tag: int = 0, *, dtype: DataType | None = None
    ) -> Request: ...
    def irecv(
        self, buf: Buffer, peer: int, tag: int = 0, *, dtype: DataType | None = None
    ) -> Request: ...
    def recv_any_source(
        self, buf: Buffer, tag: int = 0, *, dtype: DataType | None = None
    ) -> int: ...
    def group(self) -> Group: ...

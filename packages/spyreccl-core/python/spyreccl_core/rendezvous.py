"""Torch-free rendezvous: hand rank 0's UniqueId to the other ranks and form a Communicator.

Two channels, both for processes of one host (spyreccl communicates through shared memory):

* a file: ``init_from_file(path, rank, size)``. Rank 0 writes the id to a private temporary
  file next to ``path`` (mode 0600) and renames it into place, so readers never see a partial
  id; the other ranks poll for it. Rank 0 removes the file once the communicator is formed
  (every rank has read it by then). Use a fresh path per job: a stale file left by a crashed
  job would be read by ranks that start before rank 0.
* a loopback TCP socket: rank 0 serves the id on ``127.0.0.1:port`` until the communicator is
  formed; the other ranks connect (retrying while rank 0 is not up yet).

``init_from_env()`` picks one of them from environment variables, which is what a launcher
sets: ``SPYRECCL_RANK``, ``SPYRECCL_WORLD_SIZE`` and either ``SPYRECCL_RENDEZVOUS_FILE`` or
``SPYRECCL_RENDEZVOUS_ADDR=127.0.0.1:<port>``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

from ._core import UNIQUE_ID_BYTES, Communicator, UniqueId

__all__ = ["init_from_env", "init_from_file", "init_from_tcp"]

ENV_RANK = "SPYRECCL_RANK"
ENV_WORLD_SIZE = "SPYRECCL_WORLD_SIZE"
ENV_FILE = "SPYRECCL_RENDEZVOUS_FILE"
ENV_ADDR = "SPYRECCL_RENDEZVOUS_ADDR"

# Prefix of every id record (file content and socket payload): rejects unrelated files or
# services and leaves room for a format change.
_MAGIC = b"SPYRECCL-UID/1\n"
_RECORD_BYTES = len(_MAGIC) + UNIQUE_ID_BYTES
_LOOPBACK_HOSTS = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1"}
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0

Timeout = timedelta | float | None


def _seconds(value: timedelta | float, what: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0:
        raise ValueError(f"{what} must be a positive duration, got {value!r}")
    return seconds


def _check_rank(rank: int, size: int, where: str) -> None:
    if size < 1:
        raise ValueError(f"{where}: world size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"{where}: rank {rank} is outside [0, world size={size})")


def _encode(uid: UniqueId) -> bytes:
    return _MAGIC + uid.to_bytes()


def _decode(record: bytes, source: str) -> UniqueId:
    if len(record) != _RECORD_BYTES or not record.startswith(_MAGIC):
        raise ValueError(
            f"{source} does not hold a spyreccl unique id ({len(record)} bytes, expected "
            f"{_RECORD_BYTES} starting with {_MAGIC!r})"
        )
    return UniqueId.from_bytes(record[len(_MAGIC) :])


def _poll(attempt: Callable[[], UniqueId | None], timeout_s: float, waiting_for: str) -> UniqueId:
    """Calls `attempt` with a growing back-off (1 ms .. 100 ms) until it returns an id."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        uid = attempt()
        if uid is not None:
            return uid
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"spyreccl rendezvous: no unique id from {waiting_for} after {timeout_s:g} s"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _communicator(rank: int, size: int, uid: UniqueId, options: dict) -> Communicator:
    return Communicator(rank, size, uid, **options)


def _options(timeout: Timeout, chunk_bytes: int, p2p_chunk_bytes: int, name: str | None) -> dict:
    return {
        "timeout": timeout,
        "chunk_bytes": chunk_bytes,
        "p2p_chunk_bytes": p2p_chunk_bytes,
        "name": name,
    }


# --------------------------------------------------------------------------------------
# File channel
# --------------------------------------------------------------------------------------


def _publish_file(path: str, uid: UniqueId) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    # mkstemp creates the file with O_EXCL and mode 0600: the id (whose nonce names the
    # shared-memory segment) is readable by this user only.
    fd, tmp = tempfile.mkstemp(prefix=".spyreccl-uid-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(uid))
        os.replace(tmp, path)  # atomic: readers see no file or the whole record
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _read_file(path: str) -> UniqueId | None:
    try:
        with open(path, "rb") as f:
            record = f.read(_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    return _decode(record, f"rendezvous file {path!r}")


def init_from_file(
    path: str | os.PathLike[str],
    rank: int,
    size: int,
    *,
    timeout: Timeout = None,
    rendezvous_timeout: timedelta | float = DEFAULT_RENDEZVOUS_TIMEOUT,
    chunk_bytes: int = 0,
    p2p_chunk_bytes: int = 0,
    name: str | None = None,
) -> Communicator:
    """Forms a communicator of `size` processes that agree on `path` (one path per job).

    `timeout` bounds every wait of the communicator (as in Communicator); the ranks other
    than 0 wait at most `rendezvous_timeout` for rank 0's file (builtin TimeoutError).
    """
    path = os.fspath(path)
    _check_rank(rank, size, "init_from_file")
    options = _options(timeout, chunk_bytes, p2p_chunk_bytes, name)
    if rank != 0:
        wait_s = _seconds(rendezvous_timeout, "rendezvous_timeout")
        uid = _poll(lambda: _read_file(path), wait_s, f"file {path!r}")
        return _communicator(rank, size, uid, options)
    uid = UniqueId()
    _publish_file(path, uid)
    try:
        return _communicator(rank, size, uid, options)
    finally:
        # Formed (every rank read the id) or failed (the id is spent): either way the file
        # must not outlive this call.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# --------------------------------------------------------------------------------------
# Loopback TCP channel
# --------------------------------------------------------------------------------------


def _parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port_text = addr.rpartition(":")
    if not sep or host not in _LOOPBACK_HOSTS:
        raise ValueError(
            f"{ENV_ADDR}={addr!r}: expected 127.0.0.1:<port> or localhost:<port> (the id is "
            "only served on the loopback interface)"
        )
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(f"{ENV_ADDR}={addr!r}: port must be an integer in [1, 65535]")
    return _LOOPBACK_HOSTS[host], port


@contextlib.contextmanager
def _serve_id(host: str, port: int, uid: UniqueId) -> Iterator[None]:
    """Serves the id record to every connecting client until the block exits."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((host, port))
    except OSError as e:
        server.close()
        raise OSError(
            e.errno, f"spyreccl rendezvous: cannot listen on {host}:{port}: {e.strerror}"
        ) from e
    server.listen(64)
    server.settimeout(0.05)  # lets the thread notice `stop` promptly
    record = _encode(uid)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):
                    conn.sendall(record)

    thread = threading.Thread(target=serve, name="spyreccl-rendezvous", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        server.close()


def _fetch_id(host: str, port: int) -> UniqueId | None:
    try:
        with socket.create_connection((host, port), timeout=5.0) as conn:
            chunks = []
            received = 0
            while received <= _RECORD_BYTES:
                chunk = conn.recv(_RECORD_BYTES + 1 - received)
                if not chunk:
                    break
                chunks.append(chunk)
                received += len(chunk)
    except (ConnectionRefusedError, ConnectionResetError, TimeoutError):
        return None  # rank 0 is not listening yet (or restarted): retry
    return _decode(b"".join(chunks), f"rendezvous server {host}:{port}")


def init_from_tcp(
    addr: str,
    rank: int,
    size: int,
    *,
    timeout: Timeout = None,
    rendezvous_timeout: timedelta | float = DEFAULT_RENDEZVOUS_TIMEOUT,
    chunk_bytes: int = 0,
    p2p_chunk_bytes: int = 0,
    name: str | None = None,
) -> Communicator:
    """Like init_from_file, but rank 0 serves the id on `addr` = "127.0.0.1:<port>"."""
    host, port = _parse_addr(addr)
    _check_rank(rank, size, "init_from_tcp")
    options = _options(timeout, chunk_bytes, p2p_chunk_bytes, name)
    if rank != 0:
        wait_s = _seconds(rendezvous_timeout, "rendezvous_timeout")
        uid = _poll(lambda: _fetch_id(host, port), wait_s, f"{host}:{port}")
        return _communicator(rank, size, uid, options)
    uid = UniqueId()
    # Communicator() returns once every rank joined, i.e. after each fetched the id.
    with _serve_id(host, port, uid):
        return _communicator(rank, size, uid, options)


def _env_int(name: str) -> int:
    text = os.environ.get(name)
    if text is None:
        raise ValueError(f"init_from_env: environment variable {name} is not set")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"init_from_env: {name}={text!r} is not an integer") from None


def init_from_env(
    *,
    timeout: Timeout = None,
    rendezvous_timeout: timedelta | float = DEFAULT_RENDEZVOUS_TIMEOUT,
    chunk_bytes: int = 0,
    p2p_chunk_bytes: int = 0,
    name: str | None = None,
) -> Communicator:
    """Forms a communicator from SPYRECCL_RANK, SPYRECCL_WORLD_SIZE and exactly one of
    SPYRECCL_RENDEZVOUS_FILE (a path) or SPYRECCL_RENDEZVOUS_ADDR (127.0.0.1:<port>)."""
    rank = _env_int(ENV_RANK)
    size = _env_int(ENV_WORLD_SIZE)
    path = os.environ.get(ENV_FILE)
    addr = os.environ.get(ENV_ADDR)
    kwargs = {
        "timeout": timeout,
        "rendezvous_timeout": rendezvous_timeout,
        "chunk_bytes": chunk_bytes,
        "p2p_chunk_bytes": p2p_chunk_bytes,
        "name": name,
    }
    if path and addr:
        raise ValueError(f"init_from_env: set only one of {ENV_FILE} and {ENV_ADDR}")
    if path:
        return init_from_file(path, rank, size, **kwargs)
    if addr:
        return init_from_tcp(addr, rank, size, **kwargs)
    raise ValueError(f"init_from_env: set {ENV_FILE} or {ENV_ADDR} to choose the rendezvous")

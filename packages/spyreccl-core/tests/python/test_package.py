"""Package surface: UniqueId, exceptions, paths, version, rendezvous helpers, launch, stub."""

from __future__ import annotations

import ast
import multiprocessing
import os
import pickle
import socket
import stat
import time
from pathlib import Path

import numpy as np
import pytest

import spyreccl_core
from spyreccl_core import _core

# ---------------------------------------------------------------------------------------
# UniqueId
# ---------------------------------------------------------------------------------------


def test_unique_id_round_trip():
    uid = spyreccl_core.UniqueId()
    raw = bytes(uid)
    assert len(raw) == spyreccl_core.UNIQUE_ID_BYTES == spyreccl_core.UniqueId.SIZE == 128
    assert uid.to_bytes() == raw
    again = spyreccl_core.UniqueId.from_bytes(raw)
    assert again == uid and hash(again) == hash(uid)
    assert pickle.loads(pickle.dumps(uid)) == uid
    assert spyreccl_core.UniqueId() != uid  # fresh nonce every time
    assert raw.hex()[:16] not in repr(uid)  # the nonce is a secret
    assert uid != raw  # no equality with plain bytes


@pytest.mark.parametrize("length", [0, 127, 129])
def test_unique_id_from_bytes_checks_length(length):
    with pytest.raises(
        ValueError, match=f"argument 'data' has {length} bytes, expected exactly 128"
    ):
        spyreccl_core.UniqueId.from_bytes(b"\0" * length)


def test_corrupted_unique_id_is_rejected():
    raw = bytearray(bytes(spyreccl_core.UniqueId()))
    raw[:8] = b"garbage!"
    with pytest.raises(spyreccl_core.SpyrecclError) as info:
        spyreccl_core.Communicator(0, 1, spyreccl_core.UniqueId.from_bytes(bytes(raw)), timeout=2)
    assert info.value.code in (
        spyreccl_core.Result.INVALID_USAGE,
        spyreccl_core.Result.INVALID_ARGUMENT,
    )


# ---------------------------------------------------------------------------------------
# Exceptions, enums, versions and paths
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "code", "builtin"),
    [
        (spyreccl_core.SystemError_, spyreccl_core.Result.SYSTEM_ERROR, OSError),
        (spyreccl_core.InternalError, spyreccl_core.Result.INTERNAL_ERROR, None),
        (spyreccl_core.InvalidArgumentError, spyreccl_core.Result.INVALID_ARGUMENT, ValueError),
        (spyreccl_core.InvalidUsageError, spyreccl_core.Result.INVALID_USAGE, None),
        (spyreccl_core.RemoteError, spyreccl_core.Result.REMOTE_ERROR, None),
        (spyreccl_core.TimeoutError, spyreccl_core.Result.TIMEOUT, TimeoutError),
        (spyreccl_core.AbortedError, spyreccl_core.Result.ABORTED, None),
        (spyreccl_core.MismatchError, spyreccl_core.Result.MISMATCH, None),
        (spyreccl_core.UnsupportedError, spyreccl_core.Result.UNSUPPORTED, None),
    ],
)
def test_exception_hierarchy(cls, code, builtin):
    assert issubclass(cls, spyreccl_core.SpyrecclError)
    assert issubclass(cls, RuntimeError)
    assert cls.code == code
    if builtin is not None:
        assert issubclass(cls, builtin)
    assert cls.__module__ == "spyreccl_core"
    error = cls("detail")
    error.code = code
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is cls and str(clone) == "detail" and clone.code == code


def test_enums_mirror_the_c_api():
    assert spyreccl_core.DataType.BFLOAT16 == 9 and spyreccl_core.DataType.BOOL == 13
    assert spyreccl_core.ReduceOp.BXOR == 7 and spyreccl_core.ReduceOp.PREMUL_SUM == 8
    assert spyreccl_core.Result.UNSUPPORTED == 9
    assert "Timeout" in spyreccl_core.error_string(spyreccl_core.Result.TIMEOUT)


def test_version_and_installed_paths():
    assert spyreccl_core.__version__ == spyreccl_core.library_version() == _core.__version__
    cmake = Path(spyreccl_core.cmake_dir())
    assert (cmake / "spyrecclConfig.cmake").is_file()
    assert (Path(spyreccl_core.include_dir()) / "spyreccl" / "spyreccl.h").is_file()
    assert Path(spyreccl_core.library_path()).is_file()


# ---------------------------------------------------------------------------------------
# Rendezvous helpers (rank processes are forked per test: these tests are about forming)
# ---------------------------------------------------------------------------------------


def _form_and_reduce(init, rank, size, conn, env=None):
    try:
        if env is not None:
            os.environ.update(env)
            os.environ["SPYRECCL_RANK"] = str(rank)
        with init(rank, size) as comm:
            x = np.full(5, comm.rank + 1, dtype=np.int32)
            comm.all_reduce(x)
            conn.send(("ok", (comm.rank, comm.size, x.tolist())))
    except BaseException as e:
        conn.send(("error", e))
    finally:
        os._exit(0)


def _run_ranks(init, size, env=None, first_alone=0.0):
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for rank in range(size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_form_and_reduce, args=(init, rank, size, child, env))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
        if rank == 0:
            time.sleep(first_alone)
    results = []
    for parent in pipes:
        assert parent.poll(30), "rank did not finish"
        results.append(parent.recv())
    for proc in procs:
        proc.join()
    return results


def _check_formed(results, size):
    expected = [size * (size + 1) // 2] * 5
    for rank, (status, payload) in enumerate(results):
        assert status == "ok", payload
        assert payload == (rank, size, expected)


def test_init_from_file(tmp_path):
    path = tmp_path / "job.id"

    def init(rank, size):
        return spyreccl_core.init_from_file(path, rank, size, timeout=10)

    _check_formed(_run_ranks(init, 3), 3)
    assert not path.exists(), "rank 0 must remove the id file once the communicator formed"
    assert not list(tmp_path.iterdir()), "temporary files left behind"


def test_init_from_file_publishes_private_file(tmp_path):
    path = tmp_path / "private.id"
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    rank0 = ctx.Process(
        target=_form_and_reduce,
        args=(lambda r, s: spyreccl_core.init_from_file(path, r, s, timeout=10), 0, 2, child),
    )
    rank0.start()
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, "rank 0 did not publish the id"
        time.sleep(0.01)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    comm = spyreccl_core.init_from_file(path, 1, 2, timeout=10)
    comm.all_reduce(np.full(5, 2, dtype=np.int32))
    comm.destroy()
    assert parent.poll(10) and parent.recv()[0] == "ok"
    rank0.join()


def test_init_from_file_times_out_without_rank0(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no unique id"):
        spyreccl_core.init_from_file(tmp_path / "never", 1, 2, rendezvous_timeout=0.3)
    assert time.monotonic() - start < 2


def test_init_from_file_rejects_foreign_file(tmp_path):
    path = tmp_path / "foreign"
    path.write_bytes(b"not an id")
    with pytest.raises(ValueError, match="does not hold a spyreccl unique id"):
        spyreccl_core.init_from_file(path, 1, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("channel", ["file", "tcp"])
def test_init_from_env(tmp_path, channel):
    env = {"SPYRECCL_WORLD_SIZE": "2"}
    if channel == "file":
        env["SPYRECCL_RENDEZVOUS_FILE"] = str(tmp_path / "env.id")
    else:
        env["SPYRECCL_RENDEZVOUS_ADDR"] = f"127.0.0.1:{_free_port()}"

    def init(rank, size):
        return spyreccl_core.init_from_env(timeout=10)

    # tcp: rank 1 starts while rank 0 is not listening yet and must retry.
    _check_formed(_run_ranks(init, 2, env=env), 2)


def test_init_from_env_errors(monkeypatch):
    for name in ("SPYRECCL_RANK", "SPYRECCL_WORLD_SIZE", "SPYRECCL_RENDEZVOUS_FILE",
                 "SPYRECCL_RENDEZVOUS_ADDR"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="SPYRECCL_RANK is not set"):
        spyreccl_core.init_from_env()
    monkeypatch.setenv("SPYRECCL_RANK", "1")
    monkeypatch.setenv("SPYRECCL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="SPYRECCL_WORLD_SIZE='two' is not an integer"):
        spyreccl_core.init_from_env()
    monkeypatch.setenv("SPYRECCL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="set SPYRECCL_RENDEZVOUS_FILE or"):
        spyreccl_core.init_from_env()
    monkeypatch.setenv("SPYRECCL_RENDEZVOUS_ADDR", "10.1.2.3:5000")
    with pytest.raises(ValueError, match="loopback"):
        spyreccl_core.init_from_env()
    monkeypatch.setenv("SPYRECCL_RENDEZVOUS_ADDR", "localhost:99999")
    with pytest.raises(ValueError, match="port must be an integer"):
        spyreccl_core.init_from_env()
    monkeypatch.setenv("SPYRECCL_RANK", "5")
    monkeypatch.setenv("SPYRECCL_RENDEZVOUS_ADDR", "localhost:5000")
    with pytest.raises(ValueError, match="rank 5 is outside"):
        spyreccl_core.init_from_env()


# ---------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------


def _sum_of_ranks(comm, n):
    x = np.full(n, comm.rank, dtype=np.float64)
    comm.all_reduce(x)
    return comm.rank, float(x[0])


def _fail_on_rank_1(comm):
    if comm.rank == 1:
        raise KeyError("boom")
    comm.barrier()  # rank 1 never arrives: RemoteError once it left


def test_launch_returns_results_in_rank_order():
    results = spyreccl_core.launch(_sum_of_ranks, 3, 100, timeout=10, launch_timeout=60)
    assert results == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_launch_reports_failing_ranks():
    with pytest.raises(spyreccl_core.LaunchError) as info:
        spyreccl_core.launch(_fail_on_rank_1, 2, timeout=10, launch_timeout=60)
    failures = info.value.failures
    assert "KeyError" in failures[1] and "boom" in failures[1]
    assert "RemoteError" in failures[0]
    assert "rank 1" in str(info.value)


# ---------------------------------------------------------------------------------------
# The stub must match the compiled module
# ---------------------------------------------------------------------------------------

STUB = Path(spyreccl_core.__file__).with_name("_core.pyi")


def _stub_tree():
    return ast.parse(STUB.read_text())


def _public(names):
    return {n for n in names if not n.startswith("_")}


def _stub_params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]


def _runtime_params(obj) -> list[str]:
    """Parameter names from pybind11's signature line, e.g. 'f(self: X, a: int) -> None'."""
    line = (obj.__doc__ or "").splitlines()[0]
    inside = line[line.index("(") + 1 : line.rindex(")")]
    names, depth, token = [], 0, ""
    for ch in inside + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            name = token.split(":")[0].strip()
            if name and name not in ("self", "*"):
                names.append(name)
            token = ""
        else:
            token += ch
    return names


def test_stub_matches_module():
    tree = _stub_tree()
    stub_names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            stub_names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stub_names.add(node.target.id)
    runtime_names = _public(dir(_core))
    assert _public(stub_names) == runtime_names

    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            assert _stub_params(node) == _runtime_params(getattr(_core, node.name)), node.name
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(_core, node.name)
        members = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
        if issubclass(cls, int):  # enums: same members with the same values
            stub_members = {
                n.targets[0].id: ast.literal_eval(n.value)
                for n in node.body
                if isinstance(n, ast.Assign)
            }
            assert stub_members == {m.name: int(m) for m in cls}, node.name
            continue
        if issubclass(cls, BaseException):
            continue  # checked by test_exception_hierarchy
        assert _public(members) == _public(vars(cls)) - {"SIZE"}, node.name
        for name, fn in members.items():
            if name.startswith("_") or isinstance(vars(cls)[name], property):
                continue
            assert _stub_params(fn) == _runtime_params(getattr(cls, name)), f"{node.name}.{name}"

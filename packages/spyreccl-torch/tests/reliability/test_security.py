"""Shared-memory hygiene and hostile neighbours.

Checked (each scenario in a freshly forked process, under umask 0 so that nothing is
private by accident):
- a segment exists only while its communicator forms, named after the id's 128-bit nonce,
  owned by us with mode 0600, unreadable by another user, and gone once every rank joined;
- nonces are distinct and look random;
- a squatter that pre-creates /dev/shm/spyreccl-<nonce> (a file or a symlink) for an id is
  refused by the creating rank (O_CREAT|O_EXCL) and by an attaching rank (O_NOFOLLOW, owner
  and mode, header validation), and its file is left untouched;
- no world-writable file is created: segments, state dumps (SPYRECCL_DUMP_DIR), the
  spyreccl_core rendezvous file, and what a torch job leaves in its directories;
- the id a torch job publishes in its store carries a fresh nonce per job and group, and it
  is the one naming the segment every rank maps.

The layout of the id (magic "SPID", version, then the 16-byte nonce at offset 8) is the
documented format of packages/spyreccl-core/src/rendezvous/unique_id.h.
"""

from __future__ import annotations

import datetime
import os
import stat
import threading
import time

import pytest
import torch
import torch.distributed as dist
from process_hygiene import mapped_segments, world_writable

from spyreccl_testing.forked import ForkedGroup, results

SHM = "/dev/shm"
NONCE = slice(8, 24)
NOBODY = 65534


def _segment_path(uid) -> str:
    return os.path.join(SHM, "spyreccl-" + bytes(uid)[NONCE].hex())


def _error(call, *args, **kwargs):
    start = time.monotonic()
    try:
        result = call(*args, **kwargs)
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "elapsed": time.monotonic() - start,
        }
    if hasattr(result, "destroy"):
        result.destroy()
    return {"type": None, "message": "", "elapsed": time.monotonic() - start}


def _as_other_user(path: str) -> str:
    """Tries to open `path` for reading as user nobody, in a child; returns what happened."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                os.close(os.open(path, os.O_RDONLY))
                code = 0
            except PermissionError:
                code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "readable", 1: "denied", 3: "setuid failed"}.get(
        os.waitstatus_to_exitcode(status), "?"
    )


def body_segment_lifecycle(ctx):
    import spyreccl_core

    os.umask(0)
    uid = spyreccl_core.UniqueId()
    path = _segment_path(uid)
    comms = {}

    def form(rank):
        comms[rank] = spyreccl_core.Communicator(rank, 2, uid, timeout=10.0)

    creator = threading.Thread(target=form, args=(0,))
    creator.start()  # rank 0 creates the segment and waits for rank 1
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)
    st = os.lstat(path)
    observed = {
        "name": os.path.basename(path),
        "regular": stat.S_ISREG(st.st_mode),
        "mode": stat.S_IMODE(st.st_mode),
        "owner_is_us": st.st_uid == os.geteuid(),
        "other_user": _as_other_user(path) if os.geteuid() == 0 else "not root",
    }
    form(1)
    creator.join()
    observed["exists_after_join"] = os.path.exists(path)
    observed["mapped"] = sorted(mapped_segments())
    for comm in comms.values():
        comm.destroy()
    observed["mapped_after_destroy"] = sorted(mapped_segments())
    nonces = [bytes(spyreccl_core.UniqueId())[NONCE] for _ in range(2000)]
    observed["distinct_nonces"] = len(set(nonces))
    observed["distinct_byte_values"] = len(set(b"".join(nonces)))
    return observed


def body_squatters(ctx):
    import spyreccl_core

    os.umask(0)
    out = {}

    def squat(kind):
        uid = spyreccl_core.UniqueId()
        path = _segment_path(uid)
        victim = os.path.join(ctx.directory, f"victim-{kind}")
        content = os.urandom(1 << 16)
        if kind == "symlink":
            with open(victim, "wb") as f:
                f.write(content)
            os.chmod(victim, 0o600)
            os.symlink(victim, path)
        else:
            mode = {"file_0644": 0o644, "garbage_0600": 0o600, "foreign_owner": 0o600}[kind]
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
            os.write(fd, content)
            os.close(fd)
            os.chmod(path, mode)
            if kind == "foreign_owner":
                os.chown(path, NOBODY, NOBODY)
            victim = path
        return uid, path, victim, content

    for kind in ["file_0644", "garbage_0600", "foreign_owner", "symlink"]:
        if kind == "foreign_owner" and os.geteuid() != 0:
            continue
        for rank in (0, 1):
            uid, path, victim, content = squat(kind)
            try:
                report = _error(spyreccl_core.Communicator, rank, 2, uid, timeout=1.0)
                with open(victim, "rb") as f:
                    report["victim_untouched"] = f.read() == content
                report["squat_still_there"] = os.path.lexists(path)
            finally:
                if os.path.lexists(path):
                    os.unlink(path)
            out[f"{kind}-rank{rank}"] = report
    return out


def body_rendezvous_file(ctx):
    """spyreccl_core's file rendezvous, under umask 0: the published id file is private."""
    import spyreccl_core

    os.umask(0)
    path = os.path.join(ctx.directory, "job.id")
    comms = {}
    creator = threading.Thread(
        target=lambda: comms.update({0: spyreccl_core.init_from_file(path, 0, 2, timeout=10)})
    )
    creator.start()
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.001)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    comms[1] = spyreccl_core.init_from_file(path, 1, 2, timeout=10)
    creator.join()
    for comm in comms.values():
        comm.destroy()
    return {"mode": mode, "left_behind": os.path.exists(path)}


def core_scenario(name: str):
    body = {
        "segment": body_segment_lifecycle,
        "squatters": body_squatters,
        "rendezvous_file": body_rendezvous_file,
    }[name]
    return results(ForkedGroup(1, body, backend="none").finish(60))[0]


def test_segment_is_private_unguessable_and_transient(launcher):
    seen = launcher.run(core_scenario, "segment")[0]
    name = seen["name"]
    assert name.startswith("spyreccl-") and len(name) == len("spyreccl-") + 32, name
    assert seen["regular"] and seen["owner_is_us"], seen
    assert seen["mode"] == 0o600, f"segment mode {seen['mode']:o} under umask 0"
    assert seen["other_user"] in ("denied", "not root"), seen
    assert not seen["exists_after_join"], "the segment name outlived the join"
    assert [os.path.basename(p) for p in seen["mapped"]] == [name]
    assert seen["mapped_after_destroy"] == []
    assert seen["distinct_nonces"] == 2000
    assert seen["distinct_byte_values"] == 256  # 32000 random bytes cover every value


@pytest.fixture(scope="module")
def squatter_reports(launcher):
    return launcher.run(core_scenario, "squatters")[0]


@pytest.mark.parametrize("kind", ["file_0644", "garbage_0600", "foreign_owner", "symlink"])
@pytest.mark.parametrize("rank", [0, 1])
def test_squatted_segment_is_refused(squatter_reports, kind, rank):
    reports = squatter_reports
    key = f"{kind}-rank{rank}"
    if key not in reports:
        pytest.skip("changing a file's owner needs root")
    report = reports[key]
    assert report["type"] is not None, f"{key}: the squatted segment was accepted"
    assert report["type"] in ("InvalidUsageError", "SystemError_", "TimeoutError"), report
    assert report["victim_untouched"], f"{key}: the squatter's file was modified"
    assert report["squat_still_there"], f"{key}: spyreccl removed a file it did not create"
    if rank == 0:
        # O_CREAT|O_EXCL: the creating rank refuses at once and says why.
        assert report["type"] == "InvalidUsageError" and "already exists" in report["message"]
    elif kind in ("file_0644", "foreign_owner"):
        assert "foreign" in report["message"] and report["elapsed"] < 1.0, report
    elif kind == "symlink":
        assert report["type"] == "SystemError_", report  # O_NOFOLLOW: ELOOP


def test_rendezvous_file_is_private_under_umask_0(launcher):
    seen = launcher.run(core_scenario, "rendezvous_file")[0]
    assert seen["mode"] == 0o600, f"id file mode {seen['mode']:o}"
    assert not seen["left_behind"]


# -- torch level ----------------------------------------------------------------------------------

ID_MAGIC = b"SPID"


def rank_torch_job(ctx, dump_dir: str):
    """Forms the world group and one sub-group, fails a collective (so that state dumps are
    written) and reports the segments it mapped, the ids in the store and any
    world-writable file in the places the job wrote to."""
    os.umask(0)
    x = torch.ones(8, device="spyre")
    dist.all_reduce(x)
    sub = dist.new_group(list(range(ctx.world_size)))
    dist.all_reduce(x, group=sub)
    mapped = sorted(os.path.basename(p) for p in mapped_segments())
    sub._get_backend(torch.device("spyre")).set_timeout(datetime.timedelta(seconds=0.3))
    if ctx.rank == 0:
        try:
            dist.all_reduce(x, group=sub)  # rank 1 never joins: timeout, dump written
        except dist.DistBackendError:
            pass
        ctx.touch("done")
    else:
        ctx.wait_for_file("done", 30)
    # torch's FileStore is an append-only log: the ids stay in it after their keys were
    # deleted by the last reader.
    with open(os.path.join(ctx.directory, "store"), "rb") as f:
        store = f.read()
    ids = []
    start = store.find(ID_MAGIC)
    while start >= 0:
        ids.append(store[start : start + 128][NONCE].hex())
        start = store.find(ID_MAGIC, start + 1)
    writable = world_writable([ctx.directory, dump_dir]) + [
        p for p in world_writable([SHM]) if os.path.basename(p).startswith("spyreccl")
    ]
    return {"mapped": mapped, "ids": ids, "writable": writable}


def torch_job_scenario(dump_dir: str, jobs: int):
    return [
        results(
            ForkedGroup(
                2, rank_torch_job, dump_dir, env={"SPYRECCL_DUMP_DIR": dump_dir}, pg_timeout=30
            ).finish(60)
        )
        for _ in range(jobs)
    ]


def test_torch_jobs_use_fresh_nonces_and_create_nothing_world_writable(launcher, tmp_path):
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()
    reports = launcher.run(torch_job_scenario, str(dump_dir), 2, timeout=120)[0]
    all_nonces = []
    for job, ranks in enumerate(reports):
        ids = ranks[0]["ids"]
        # One id per group (world + sub-group), each naming the segment every rank maps.
        assert len(ids) == 2, ranks
        expected = sorted(f"spyreccl-{nonce}" for nonce in ids)
        for rank, report in enumerate(ranks):
            assert not report["writable"], f"job {job} rank {rank}: {report['writable']}"
            assert report["mapped"] == expected, f"job {job} rank {rank}: {report}, ids {ids}"
        all_nonces += ids
    assert len(set(all_nonces)) == len(all_nonces), "a nonce was reused across groups or jobs"
    dumps = list(dump_dir.iterdir())
    assert dumps, "the failed collective wrote no state dump"
    for path in dumps:
        assert not stat.S_IMODE(path.stat().st_mode) & 0o022, f"{path} is group/world writable"

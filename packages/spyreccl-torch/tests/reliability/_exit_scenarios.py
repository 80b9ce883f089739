"""One rank of test_interpreter_exit.py: leaves the interpreter while backend threads still
have work that ends in Python code. Run as ``python _exit_scenarios.py DIR`` with RANK and
WORLD_SIZE=2 in the environment; rank 0 is the one under test, rank 1 its peer.

Rank 0 sets up three hazards, then returns from the script normally:

1. An async spyreccl all_reduce with a Python callback, not waited for; rank 1 joins it
   only after rank 0's script has ended (it completes while the exit hook drains the group).
2. A gloo all_reduce with a guarded callback (spyreccl_torch._C._add_guarded_callback);
   rank 1 joins it only once rank 0's interpreter is finalizing (a module's deletion
   signals it and then sleeps), so gloo's thread completes it during finalization. With
   torch's own ``future.add_done_callback`` instead, rank 0 aborts there ("terminate called
   without an active exception", exit code -6).
3. A multi-node group (the two ranks as nodes of their own) whose gloo stage rank 0
   abandoned (rank 1 failed before its own) before destroying the group; rank 1's end
   closes only when it exits, once rank 0 is finalizing, so gloo's thread ends the stage
   then.

Files in DIR record what happened; the test checks them and both exit codes.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
from pathlib import Path

DIR = Path(sys.argv[1])
RANK = int(os.environ["RANK"])


def _wait_for(name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (DIR / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {RANK}: no {name} after {timeout} s")
        time.sleep(0.01)


class _Sleeper:
    """Deleted with the modules, i.e. once finalization has begun (after every atexit hook):
    tells rank 1 to complete the gloo operation now, and keeps the interpreter finalizing
    (GIL released) while gloo's thread completes it."""

    def __del__(self) -> None:
        (DIR / "finalizing").touch()
        time.sleep(1.5)


import torch  # noqa: E402  (after _Sleeper: nothing above needs torch)
import torch.distributed as dist  # noqa: E402
from _exit_helpers import abandon_a_stage, delete_during_finalization  # noqa: E402

import spyreccl_torch  # noqa: E402

timeout = datetime.timedelta(seconds=60)
store = dist.FileStore(str(DIR / "store"), 2)
gen = torch.Generator().manual_seed(1234 + RANK)
mine = torch.randn(257, dtype=torch.float64, generator=gen).float()
torch.save(mine, DIR / f"input{RANK}.pt")

dist.init_process_group("spyreccl", store=store, rank=RANK, world_size=2, timeout=timeout)

# -- fork: a child forked after the groups exist exits normally and at once -----------------
# It inherits the spyreccl group and the registry of progress threads but not the threads:
# neither the exit hook nor the group's destructor may try to stop (join) them there, which
# would hang the child. (Before any gloo group exists: torch's gloo groups hang a forked
# child's exit the same way, in their own destructors.)
if RANK == 0:
    dist.all_reduce(mine.to("spyre"))  # the group's progress thread exists and has run
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a normal exit: atexit hooks run
    deadline = time.monotonic() + 30
    status = "hung"
    while time.monotonic() < deadline:
        pid, code = os.waitpid(child, os.WNOHANG)
        if pid == child:
            status = repr(os.waitstatus_to_exitcode(code))
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        os.waitpid(child, 0)
    (DIR / "fork_child").write_text(status)
else:
    dist.all_reduce(mine.to("spyre"))

# -- a group destroyed on its own progress thread -------------------------------------------
# A Python callback that its progress thread runs drops the last reference to a group: the
# group's destructor then runs on that thread, which cannot join itself (a joinable
# std::thread destroyed there would abort the process).
if RANK == 0:
    import threading

    def _progress_threads() -> int:
        count = 0
        for task in Path("/proc/self/task").iterdir():
            try:
                count += (task / "comm").read_text().strip() == "spyreccl-prog"
            except OSError:
                pass
        return count

    before = _progress_threads()
    solo = spyreccl_torch.ProcessGroupSpyreccl(dist.FileStore(str(DIR / "solo"), 1), 0, 1)
    holder = [solo]
    del solo
    dropped = threading.Event()
    seen: list = []

    def drop_group(fut: torch.futures.Future) -> None:
        seen.append(threading.current_thread().name)
        holder.clear()  # the last reference
        dropped.set()

    # A 1-rank operation completes within microseconds of reaching the thread: a copy of
    # 64 MiB queued first keeps it busy, so that the callback is chained to a Future that
    # has not completed yet and runs on the progress thread (not inline on this one).
    big = torch.empty(16 << 20, device="spyre")
    holder[0]._allgather_base(torch.empty_like(big), big)
    work = holder[0].allreduce([mine.to("spyre")])
    work.get_future().then(drop_group)
    del work
    dropped.wait(30)
    deadline = time.monotonic() + 10
    while _progress_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread ends once its loop has finished
    (DIR / "own_thread").write_text(repr((seen, before, _progress_threads())))

# -- 0. guarded callbacks while the interpreter is alive -------------------------------------
# One on an operation that succeeds, one on an operation that times out (rank 1 never joins
# the group `lonely`'s operation): each runs once, on gloo's thread, with None or the error.
# The group connects under the job's timeout (a loaded machine can take over a second to
# connect); only the operation that rank 1 never joins has the short one.
lonely = dist.ProcessGroupGloo(dist.PrefixStore("lonely/", store), RANK, 2, timeout)
lonely_opts = dist.AllreduceOptions()
lonely_opts.timeout = datetime.timedelta(seconds=1)
gloo_ok = dist.ProcessGroupGloo(dist.PrefixStore("ok/", store), RANK, 2, timeout)
t0 = mine.clone()
if RANK == 0:

    def recorder(name: str):
        def record(error: str | None) -> None:
            import threading

            (DIR / name).write_text(repr((error, threading.current_thread().name)))

        return record

    spyreccl_torch._C._add_guarded_callback(
        lonely.allreduce([t0.clone()], lonely_opts), recorder("failed_cb")
    )
    spyreccl_torch._C._add_guarded_callback(gloo_ok.allreduce([t0]), recorder("ok_cb"))
    _wait_for("ok_cb")
    _wait_for("failed_cb")
else:
    gloo_ok.allreduce([t0]).wait()


# -- 3. a multi-node group's gloo stage abandoned, then ended by the peer's exit ------------------
# Rank 1 fails just before its gloo stage, rank 0 gives up on its own on rank 1's published
# failure, leaving it pending in gloo (_exit_helpers.py), and destroys the group. Rank 1's
# end closes only when it exits, after rank 0 began finalizing: gloo's thread then ends the
# stage with an error there. The group keeps the stage's Work referenced meanwhile, so that
# thread does not release it (multinode/hierarchical.py, shutdown). This scenario exits
# cleanly without that too: once finalization has begun, torch leaks the Python object of a
# tensor it releases rather than take the GIL (it checks Py_IsInitialized first). The abort
# needs a thread that asked for the GIL just before that moment and waits across it:
# _exit_abandoned_stage.py makes that happen every time.
nodes = abandon_a_stage(DIR, RANK, "abandoned", timeout)
if RANK == 0:
    dist.destroy_process_group(nodes)
    del nodes
    gc.collect()

# -- 1. an async operation still pending when the script ends ---------------------------------
gloo = dist.new_group(backend="gloo", timeout=timeout)
t2 = mine.to("spyre")
if RANK == 0:
    pending = dist.all_reduce(t2, async_op=True)

    def record(fut: torch.futures.Future) -> None:
        (DIR / "pending_result").write_text(repr(fut.value()[0].cpu().double().sum().item()))

    pending.get_future().then(record)

# -- 2. a gloo operation completing while the interpreter finalizes ---------------------------
t3 = mine.clone()
if RANK == 0:
    late = gloo.allreduce([t3])

    def late_callback(error: str | None) -> None:
        (DIR / "late_callback_ran").write_text(repr(error))

    spyreccl_torch._C._add_guarded_callback(late, late_callback)
    # Deleted once finalization has begun (not a global of this script: the callbacks above
    # refer to its globals, so they outlive finalization).
    delete_during_finalization("_spyreccl_exit_sleeper", _Sleeper())
    (DIR / "script_done").touch()
else:
    _wait_for("script_done")
    time.sleep(1.0)  # rank 0 is in its exit hook now, draining operation 2
    dist.all_reduce(t2)
    _wait_for("finalizing")
    gloo.allreduce([t3]).wait()
    (DIR / "peer_late_result").write_text(repr(t3.double().sum().item()))
    # The peer is not under test: free its gloo groups now, so that their destructors join
    # gloo's worker threads before this interpreter finalizes (a worker releasing a finished
    # operation's tensors during finalization aborts the process: torch's own race, see the
    # user guide's "At interpreter exit"). Not the failed multi-node group's: a thread of its
    # own keeps them until this process exits, and that exit ends rank 0's abandoned stage.
    dist.destroy_process_group()
    del gloo, lonely, gloo_ok, nodes
    gc.collect()

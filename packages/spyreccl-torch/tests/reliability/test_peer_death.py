"""A rank SIGKILLed in the middle of a stream of collectives.

Every case forks a fresh 3-rank group (spyreccl_testing.forked) in which all ranks run the same
operation in a loop; once every rank is inside the loop the launcher SIGKILLs rank 1 at a
random moment. The survivors must raise within 2 s of the death (the group timeout is 30 s,
so a detection by timeout cannot pass), with a message naming the operation, its sequence
number and the dead rank; they must then be able to destroy the process group and exit
normally, and nothing may be left in /dev/shm. In the small cases the survivors leave through
libc exit(), so the static destructors of libtorch, libspyreccl and the backend run too (that
costs ~2 s of copy-on-write faults per forked rank, too much for every case). SPYRECCL_DUMP_DIR
is set, so every survivor also writes its state dump.
"""

from __future__ import annotations

import random
import re
import time

import pytest
import torch
import torch.distributed as dist
from process_hygiene import new_segments, read_dumps, shm_segments

from spyreccl_testing.forked import ForkedGroup

WORLD_SIZE = 3
VICTIM = 1
GROUP_TIMEOUT_S = 30.0
DETECTION_LIMIT_S = 2.0
SMALL = 37  # odd; one-shot paths, fits the staging area
LARGE = 2 * 1024 * 1024 + 3  # 8 MiB of float32: many pipeline chunks, the kill lands mid-transfer

# torch-level operation -> the name the core uses in its messages.
CORE_NAMES = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all": "alltoall",
    "send_recv": "recv",  # the survivors are the receivers
    "barrier": "barrier",
    # The functional collective DTensor and compiled graphs call (all_reduce_ + wait_tensor):
    # small ones run on the calling thread, large ones on the progress thread.
    "functional_all_reduce": "allreduce",
    # The same as a compiled graph's Python wrapper calls it when the wait comes next
    # (spyreccl_torch._C._direct_op(..., wait_follows=True); inline up to 4 MiB).
    "direct_functional_all_reduce": "allreduce",
}


def _make_step(op: str, numel: int, rank: int, world: int):
    """One call of `op` for this rank, with buffers allocated once."""
    device = "spyre"
    x = torch.zeros(numel, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    if op == "all_gather":
        out = torch.empty(numel * world, device=device)
        return lambda: dist.all_gather_single(out, x)
    if op == "reduce_scatter":
        big = torch.zeros(numel * world, device=device)
        return lambda: dist.reduce_scatter_single(x, big)
    if op == "broadcast":
        return lambda: dist.broadcast(x, src=0)
    if op == "all_to_all":
        send = torch.zeros(numel * world, device=device)
        recv = torch.empty(numel * world, device=device)
        return lambda: dist.all_to_all_single(recv, send)
    if op == "barrier":
        return lambda: dist.barrier()
    if op == "functional_all_reduce":
        functional = torch.ops._c10d_functional
        name = dist.group.WORLD.group_name
        return lambda: functional.wait_tensor(functional.all_reduce_(x, "sum", name))
    if op == "direct_functional_all_reduce":
        from spyreccl_torch._C import _direct_op

        functional = torch.ops._c10d_functional
        all_reduce_ = _direct_op(functional.all_reduce_.default, wait_follows=True)
        wait_tensor = _direct_op(functional.wait_tensor.default)
        name = dist.group.WORLD.group_name
        return lambda: wait_tensor(all_reduce_(x, "sum", name))
    if op == "send_recv":
        # The victim streams messages to every survivor; survivors wait on it directly.
        if rank == VICTIM:

            def send_all():
                for peer in range(world):
                    if peer != VICTIM:
                        dist.send(x, peer)

            return send_all
        return lambda: dist.recv(x, VICTIM)
    raise AssertionError(op)


def rank_loop(ctx, op: str, numel: int):
    """Runs `op` until it fails (or 20 s pass); reports how and when it failed."""
    backend = dist.group.WORLD._get_backend(torch.device("spyre"))
    step = _make_step(op, numel, ctx.rank, ctx.world_size)
    step()  # the group works before anybody dies
    ctx.event("running")
    deadline = time.monotonic() + 20.0
    calls = 0
    while time.monotonic() < deadline:
        seq = backend._get_sequence_number_for_group() + 1
        try:
            step()
        except Exception as exc:
            failed_at = time.monotonic()
            start = time.monotonic()
            dist.destroy_process_group()
            return {
                "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                "is_dist_backend_error": isinstance(exc, dist.DistBackendError),
                "message": str(exc),
                "seq": seq,
                "failed_at": failed_at,
                "destroy_s": time.monotonic() - start,
                "calls": calls,
            }
        calls += 1
    return {"exc_type": None, "calls": calls}


def kill_scenario(op: str, numel: int, dump_dir: str, seed: int):
    """Runs in the launcher: forks the group, kills the victim, collects what happened."""
    before = shm_segments()
    group = ForkedGroup(
        WORLD_SIZE,
        rank_loop,
        op,
        numel,
        pg_timeout=GROUP_TIMEOUT_S,
        env={"SPYRECCL_DUMP_DIR": dump_dir},
        full_exit=numel == SMALL,
    )
    started = group.wait_event("running", timeout=60.0)
    killed_at = None
    if started:
        # Anywhere in the stream: between calls, in the descriptor step or mid-transfer.
        time.sleep(random.Random(seed).uniform(0.0, 0.1))
        killed_at = group.kill(VICTIM)
    outcomes = group.finish(timeout=30.0)
    return {
        "started": started,
        "killed_at": killed_at,
        "outcomes": [vars(o) for o in outcomes],
        "leaked": new_segments(before),
        "dumps": read_dumps(dump_dir),
    }


# The core numbers collectives only ("allreduce seq 12"); for a send/recv the backend names
# the c10d sequence number itself ("recv seq 12 from rank 1").
@pytest.mark.parametrize("numel", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("op", list(CORE_NAMES))
def test_survivors_report_the_dead_rank_promptly(launcher, tmp_path, op, numel):
    seed = random.getrandbits(32)
    (report,) = launcher.run(kill_scenario, op, numel, str(tmp_path), seed, timeout=150)
    stories = "\n".join(f"rank {o['rank']}: {o}" for o in report["outcomes"])
    assert report["started"], f"the group never reached its collective loop:\n{stories}"
    assert report["outcomes"][VICTIM]["exitcode"] == -9, stories

    for outcome in report["outcomes"]:
        rank = outcome["rank"]
        if rank == VICTIM:
            continue
        result = outcome["result"]
        assert outcome["error"] is None, f"rank {rank} crashed:\n{outcome['error']}"
        assert result is not None and result["exc_type"] is not None, (
            f"rank {rank} never noticed that rank {VICTIM} died: {result}"
        )
        message = result["message"]
        assert result["is_dist_backend_error"], (
            f"rank {rank} raised {result['exc_type']}, expected DistBackendError: {message}"
        )
        delay = result["failed_at"] - report["killed_at"]
        assert 0.0 <= delay < DETECTION_LIMIT_S, (
            f"rank {rank} raised {delay:.3f} s after the death (limit {DETECTION_LIMIT_S} s, "
            f"group timeout {GROUP_TIMEOUT_S} s):\n{message}"
        )
        # The operation and the dead rank are named (the sequence number: see the end).
        assert CORE_NAMES[op] in message, f"rank {rank}: {op} not named:\n{message}"
        # The root cause leads, also on a rank whose other peer failed first because of it.
        assert re.search(rf"^rank {VICTIM} \(pid \d+\) died during ", message, re.MULTILINE), (
            f"rank {rank}: the dead rank {VICTIM} is not identified:\n{message}"
        )
        # The flight-recorder-like dump travels in the message ...
        assert "last 16 collectives" in message or "collectives on this rank" in message, message
        # ... and was written to SPYRECCL_DUMP_DIR.
        dumps = [
            text for name, text in report["dumps"].items() if name.endswith(f"-rank{rank}.txt")
        ]
        assert dumps, f"no dump of rank {rank} in SPYRECCL_DUMP_DIR: {sorted(report['dumps'])}"
        # The core's part of the message (all but the backend's first line) and its dump.
        assert message.splitlines()[1] in dumps[0] and "[process exited]" in dumps[0], dumps[0]
        # Clean teardown: destroy_process_group returns, the process exits normally.
        assert result["destroy_s"] < 5.0, result
        assert outcome["exitcode"] == 0, f"rank {rank} did not exit cleanly: {outcome}"
        assert outcome["exit_seconds"] is not None and outcome["exit_seconds"] < 10.0, outcome

    assert not report["leaked"], f"segments left in /dev/shm: {report['leaked']}"

    # The sequence number of the failed operation is named (checked last: the rest of the
    # report says more when something else went wrong).
    for outcome in report["outcomes"]:
        if outcome["rank"] != VICTIM:
            result = outcome["result"]
            assert re.search(rf"\bseq {result['seq']}\b", result["message"]), (
                f"rank {outcome['rank']}: the sequence number {result['seq']} of the failed "
                f"{op} is not named:\n{result['message']}"
            )

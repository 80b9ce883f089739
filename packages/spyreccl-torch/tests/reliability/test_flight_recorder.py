"""The flight recorder, read by torch's own analyzer (torchfrtrace) unmodified.

Each scenario forks a fresh 3-rank group whose ranks dump to a folder of the test's
(TORCH_FR_DUMP_TEMP_FILE), then runs ``python -m torch.distributed.flight_recorder.fr_trace``
over that folder and checks the text it prints: which rank did not join which collective,
or which rank called something else. A healthy job (eager, functional and point-to-point
calls) must leave no dump, and its on-demand dumps must read as one consistent run.
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _flight_support import analyze

from spyreccl_testing.accuracy import assert_close_dtype, reference_reduce
from spyreccl_testing.forked import ForkedGroup, results
from spyreccl_testing.inputs import fresh_seed, poison_, random_tensor, rank_seed

WORLD_SIZE = 3
GROUP_TIMEOUT_S = 3.0
# Upper slack for a loaded 2-core machine: failing at all instead of hanging is the point.
SLACK_S = 30.0
PREFIX = "fr_rank_"


def _checked_all_reduces(ctx, seed: int, count: int) -> None:
    """`count` all_reduces of fresh random inputs, each compared with a host reference."""
    for step in range(count):
        inputs = [
            random_tensor(13 + step, torch.float32, seed=rank_seed(seed + step, r), nranks=3)
            for r in range(ctx.world_size)
        ]
        x = inputs[ctx.rank].to("spyre")
        dist.all_reduce(x)
        assert_close_dtype(
            x.cpu(), reference_reduce(inputs, "sum"), torch.float32, ctx.world_size, seed=seed
        )


def _last_collective_seq() -> int:
    from spyreccl_torch import flight_recorder

    entries = pickle.loads(flight_recorder.dump())["entries"]
    return max(entry["collective_seq_id"] for entry in entries)


def _timed_failure(call) -> tuple[float, str, str]:
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    raise AssertionError(f"expected a failure, got none after {time.monotonic() - start:.1f}s")


def _dump_env(folder: str) -> dict[str, str]:
    return {"TORCH_FR_DUMP_TEMP_FILE": os.path.join(folder, PREFIX)}


# -- (a) a rank skips an all_reduce and waits outside any collective -----------------------


def rank_skips_all_reduce(ctx, seed: int, folder: str):
    _checked_all_reduces(ctx, seed, 3)
    missed = _last_collective_seq() + 1
    x = random_tensor(8, torch.float32, "spyre", rank_seed(seed, ctx.rank))
    if ctx.rank == 2:
        # Sleeps in Python, outside any collective: the other ranks' failure reaches it
        # through the store, and it is dumped while it sleeps.
        own_dump = os.path.join(folder, f"{PREFIX}{ctx.rank}")
        start = time.monotonic()
        while not os.path.exists(own_dump) and time.monotonic() < start + GROUP_TIMEOUT_S + SLACK_S:
            time.sleep(0.1)
        return (
            missed,
            time.monotonic() - start,
            "dumped while sleeping",
            "",
            os.path.exists(own_dump),
        )
    elapsed, kind, message = _timed_failure(lambda: dist.all_reduce(x))
    return missed, elapsed, kind, message, True


def _run_and_analyze(launcher, scenario) -> tuple[list, list[str], str]:
    """Runs a failing scenario with a fresh dump folder; returns the ranks' reports, the
    files the ranks dumped there, and torch's analyzer's output over them."""
    with tempfile.TemporaryDirectory() as folder:
        reports = launcher.run(scenario, fresh_seed(), folder, timeout=180)[0]
        return reports, sorted(os.listdir(folder)), analyze(folder)


def test_rank_that_skips_an_all_reduce_is_named_by_torch_analyzer(launcher):
    reports, dumps, output = _run_and_analyze(launcher, _skip_scenario)
    assert dumps == [f"{PREFIX}{r}" for r in range(WORLD_SIZE)], dumps
    missed = reports[0][0]
    for rank, (seq, elapsed, kind, message, dumped_while_waiting) in enumerate(reports):
        assert seq == missed, reports
        assert kind == ("dumped while sleeping" if rank == 2 else "DistBackendError"), (
            rank,
            kind,
            message,
        )
        assert elapsed <= GROUP_TIMEOUT_S + SLACK_S, (rank, elapsed, message)
        assert dumped_while_waiting, f"rank {rank} was not dumped"
    assert f"Not all ranks joining collective, sequence number: {missed}" in output, output
    assert "missing ranks: {2}" in output, output
    assert "collective: nccl:all_reduce" in output, output


def _skip_scenario(seed: int, folder: str):
    group = ForkedGroup(
        WORLD_SIZE,
        rank_skips_all_reduce,
        seed,
        folder,
        pg_timeout=GROUP_TIMEOUT_S,
        env=_dump_env(folder),
    )
    return results(group.finish(120))


# -- (b) a rank calls another collective ----------------------------------------------------


def rank_calls_all_gather(ctx, seed: int):
    _checked_all_reduces(ctx, seed, 2)
    missed = _last_collective_seq() + 1
    x = random_tensor(8, torch.float32, "spyre", rank_seed(seed, ctx.rank))
    if ctx.rank == 1:
        outputs = [poison_(torch.empty(8, device="spyre")) for _ in range(ctx.world_size)]
        failure = _timed_failure(lambda: dist.all_gather(outputs, x))
    else:
        failure = _timed_failure(lambda: dist.all_reduce(x))
    return missed, *failure


def _mismatch_scenario(seed: int, folder: str):
    group = ForkedGroup(
        WORLD_SIZE, rank_calls_all_gather, seed, pg_timeout=30, env=_dump_env(folder)
    )
    return results(group.finish(120))


def test_mismatched_collective_is_named_by_torch_analyzer(launcher):
    reports, dumps, output = _run_and_analyze(launcher, _mismatch_scenario)
    assert dumps == [f"{PREFIX}{r}" for r in range(WORLD_SIZE)], dumps
    missed = reports[0][0]
    for rank, (_seq, _elapsed, kind, message) in enumerate(reports):
        assert kind == "DistBackendError", (rank, kind, message)
    assert f"Collective sequence number: {missed} has errors" in output, output
    assert re.search(
        r"Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: "
        r"'all_reduce' does not match found collective type: 'all_gather'",
        output,
    ), output


# -- (d) a healthy job: no dump; on-demand dumps read as one consistent run -------------------


def rank_healthy(ctx, seed: int, folder: str):
    from spyreccl_torch import flight_recorder

    _checked_all_reduces(ctx, seed, 3)
    world = ctx.world_size
    inputs = [random_tensor(5, torch.float32, seed=rank_seed(seed, r)) for r in range(world)]
    # A functional collective (what DTensor and compiled graphs call), waited at once.
    summed = funcol.all_reduce(inputs[ctx.rank].to("spyre"), "sum", dist.group.WORLD)
    assert_close_dtype(
        funcol.wait_tensor(summed).cpu(),
        reference_reduce(inputs, "sum"),
        torch.float32,
        world,
        seed=seed,
    )
    outputs = [poison_(torch.empty(5, device="spyre")) for _ in range(world)]
    dist.all_gather(outputs, inputs[ctx.rank].to("spyre"))
    for r in range(world):
        assert torch.equal(outputs[r].cpu(), inputs[r])
    dist.barrier()
    # On-demand dump of the collectives, for the analyzer (it pairs point-to-point calls only
    # inside batches of NCCL's own shape, so those stay out of what it reads).
    on_demand = os.path.join(folder, "on_demand")
    os.makedirs(on_demand, exist_ok=True)
    with open(os.path.join(on_demand, f"{PREFIX}{ctx.rank}"), "wb") as out:
        out.write(flight_recorder.dump())
    # A ring of sends and receives (p2p entries).
    received = poison_(torch.empty(5, device="spyre"))
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, inputs[ctx.rank].to("spyre"), (ctx.rank + 1) % world),
            dist.P2POp(dist.irecv, received, (ctx.rank - 1) % world),
        ]
    )
    for request in requests:
        request.wait()
    assert torch.equal(received.cpu(), inputs[(ctx.rank - 1) % world])
    record = pickle.loads(flight_recorder.dump())
    return [
        (e["profiling_name"], e["state"], e["collective_seq_id"], e["p2p_seq_id"])
        for e in record["entries"]
    ], record["pg_config"]


def _healthy_scenario(seed: int, folder: str):
    group = ForkedGroup(WORLD_SIZE, rank_healthy, seed, folder, env=_dump_env(folder))
    return results(group.finish(120))


def test_healthy_job_leaves_no_dump_and_reads_clean(launcher):
    with tempfile.TemporaryDirectory() as folder:
        reports = launcher.run(_healthy_scenario, fresh_seed(), folder, timeout=180)[0]
        left = sorted(os.listdir(folder))
        output = analyze(os.path.join(folder, "on_demand"))
    assert left == ["on_demand"], f"a healthy job left dumps: {left}"
    for rank, (entries, pg_config) in enumerate(reports):
        names = [name for name, *_ in entries]
        assert names[:5] == ["nccl:all_reduce"] * 4 + ["nccl:all_gather"], (rank, names)
        assert f"nccl:send {rank}->{(rank + 1) % WORLD_SIZE}" in names, (rank, names)
        assert f"nccl:recv {rank}<-{(rank - 1) % WORLD_SIZE}" in names, (rank, names)
        assert names[5] == "nccl:all_reduce_barrier", (rank, names)
        assert all(state == "completed" for _, state, *_ in entries), (rank, entries)
        # Collective numbers count collectives only; p2p numbers count sends and receives.
        collective = [c for name, _, c, _ in entries if "send" not in name and "recv" not in name]
        assert collective == list(range(1, len(collective) + 1)), (rank, entries)
        assert [p for name, _, _, p in entries if "send" in name or "recv" in name] == [1, 2]
        assert any(cfg["ranks"] == "[0, 1, 2]" for cfg in pg_config.values()), pg_config
    assert "has errors" not in output and "Not all ranks" not in output, output


# -- a receive from any source and the monitored barrier --------------------------------------


def _entries() -> list[dict]:
    from spyreccl_torch import flight_recorder

    return pickle.loads(flight_recorder.dump())["entries"]


def rank_any_source_and_monitored(ctx, seed: int, folder: str):
    """Rank 1 sends to rank 0, which receives from any source; rank 0 dumps while its
    receive waits (rank 1 sends only once that dump is written), then again after it; then
    every rank passes a monitored barrier. Returns the three views of the recorder."""
    _checked_all_reduces(ctx, seed, 2)
    sent = random_tensor(7, torch.float32, seed=rank_seed(seed, 1))
    marker = os.path.join(folder, "pending_dumped")
    waiting: list[dict] = []
    if ctx.rank == 0:
        received = poison_(torch.empty(7, device="spyre"))
        work = dist.irecv(received)  # no src: a receive from any source
        waiting = _entries()
        open(marker, "w").close()
        work.wait()
        assert torch.equal(received.cpu(), sent)
    elif ctx.rank == 1:
        start = time.monotonic()
        while not os.path.exists(marker) and time.monotonic() < start + SLACK_S:
            time.sleep(0.05)
        dist.send(sent.to("spyre"), 0)
    received_view = _entries()
    backend = dist.group.WORLD._get_backend(torch.device("spyre"))
    backend.monitored_barrier(datetime.timedelta(seconds=30), False)
    return waiting, received_view, _entries()


def _any_source_scenario(seed: int, folder: str):
    group = ForkedGroup(
        WORLD_SIZE, rank_any_source_and_monitored, seed, folder, env=_dump_env(folder)
    )
    return results(group.finish(120))


def _view(entries: list[dict]) -> list[tuple]:
    return [(e["profiling_name"], e["state"], e["collective_seq_id"]) for e in entries]


def test_any_source_receive_and_monitored_barrier_are_recorded(launcher):
    with tempfile.TemporaryDirectory() as folder:
        reports = launcher.run(_any_source_scenario, fresh_seed(), folder, timeout=180)[0]
        left = sorted(os.listdir(folder))
    assert left == ["pending_dumped"], f"a healthy job left dumps: {left}"
    waiting, received, _ = reports[0]
    # While it waits, the receive names no sender ("-1", c10d's "any").
    pending = _view(waiting)[-1]
    assert pending[0] == "nccl:recv 0<--1" and pending[1] != "completed", _view(waiting)
    # Once done, the same entry names the rank that sent.
    assert _view(received)[-1][:2] == ("nccl:recv 0<-1", "completed"), _view(received)
    assert _view(reports[1][1])[-1][:2] == ("nccl:send 1->0", "completed"), reports[1][1]
    for rank, (_, _, after) in enumerate(reports):
        # The monitored barrier is the group's next collective (two all_reduces before it).
        assert _view(after)[-1] == ("nccl:all_reduce_barrier monitored", "completed", 3), (
            rank,
            _view(after),
        )


def rank_skips_monitored_barrier(ctx, seed: int, folder: str):
    _checked_all_reduces(ctx, seed, 2)
    missed = _last_collective_seq() + 1
    if ctx.rank == 2:
        own_dump = os.path.join(folder, f"{PREFIX}{ctx.rank}")
        start = time.monotonic()
        while not os.path.exists(own_dump) and time.monotonic() < start + GROUP_TIMEOUT_S + SLACK_S:
            time.sleep(0.1)
        return missed, "dumped while sleeping", os.path.exists(own_dump)
    backend = dist.group.WORLD._get_backend(torch.device("spyre"))
    _, kind, message = _timed_failure(
        lambda: backend.monitored_barrier(datetime.timedelta(seconds=GROUP_TIMEOUT_S), False)
    )
    return missed, kind, "not all ranks" in message


def _monitored_skip_scenario(seed: int, folder: str):
    group = ForkedGroup(
        WORLD_SIZE, rank_skips_monitored_barrier, seed, folder, env=_dump_env(folder)
    )
    return results(group.finish(120))


def test_rank_that_skips_a_monitored_barrier_is_named_by_torch_analyzer(launcher):
    reports, dumps, output = _run_and_analyze(launcher, _monitored_skip_scenario)
    assert dumps == [f"{PREFIX}{r}" for r in range(WORLD_SIZE)], (dumps, reports)
    missed = reports[0][0]
    assert reports == [
        (missed, "DistBackendError", True),
        (missed, "DistBackendError", True),
        (missed, "dumped while sleeping", True),
    ], reports
    assert f"Not all ranks joining collective, sequence number: {missed}" in output, output
    assert "collective: nccl:all_reduce_barrier monitored" in output, output
    assert "missing ranks: {2}" in output, output


def rank_recording_off(ctx, seed: int):
    from spyreccl_torch import flight_recorder

    _checked_all_reduces(ctx, seed, 2)
    return pickle.loads(flight_recorder.dump())["entries"]


def _recording_off_scenario(seed: int):
    group = ForkedGroup(WORLD_SIZE, rank_recording_off, seed, env={"TORCH_FR_BUFFER_SIZE": "0"})
    return results(group.finish(120))


def test_buffer_size_zero_records_nothing(launcher):
    reports = launcher.run(_recording_off_scenario, fresh_seed(), timeout=180)[0]
    assert reports == [[]] * WORLD_SIZE, reports

"""The flight recorder on 2 simulated nodes x 2 ranks, read by torch's analyzer unmodified.

Rank 3 (node 1) skips one all_reduce of the world group (a hierarchical group) and sleeps
outside any collective; the others call it and fail within the group timeout. Every rank must
dump (rank 3 through the failure its node mate reports in the store), and
``python -m torch.distributed.flight_recorder.fr_trace`` over the dumps must name rank 3 and
the missed all_reduce's sequence number. Without the check exchange, rank 0 hangs in the
stage between the nodes, which its node 1 partner (rank 2, stuck on node 1 waiting for rank
3) never joins: the analyzer must also name that stage, rank 2 and the call it belongs to.
A collective mismatch that the check exchange finds must dump on every rank too.
"""

from __future__ import annotations

import os
import re

from _flight_support import analyze
from _launch import run_job

from spyreccl_testing.inputs import fresh_seed

JOB_TIMEOUT = 240.0
PG_TIMEOUT_S = 5.0
SLACK_S = 30.0
SKIPPER = 3


def _run_skip(tmp_path, check: str) -> tuple[int, str, dict]:
    """The skip job (checking `check`): returns the missed sequence number, the analyzer's
    output over every rank's dump, and the ranks' reports."""
    dumps = tmp_path / "dumps"
    result = run_job(
        [2, 2],
        "skip",
        tmp_path / "out",
        timeout=JOB_TIMEOUT,
        env={
            "SPYRECCL_MN_SKIPPER": str(SKIPPER),
            "SPYRECCL_MN_PG_TIMEOUT": str(PG_TIMEOUT_S),
            "SPYRECCL_MN_SEED": str(fresh_seed()),
            "SPYRECCL_MULTINODE_CHECK": check,
            "TORCH_FR_DUMP_TEMP_FILE": str(dumps / "fr_rank_"),
        },
        stop_after_reports=4,
    )
    context = result.describe()
    assert sorted(result.reports) == [0, 1, 2, 3], context
    missed = {report["missed"] for report in result.reports.values()}
    assert len(missed) == 1, context
    (missed,) = missed
    for rank, report in sorted(result.reports.items()):
        assert not report["failures"], (rank, report["failures"])
        if rank == SKIPPER:
            assert report["dumped"], f"rank {rank} was not dumped while sleeping; {context}"
        else:
            assert report["error"] and "DistBackendError" in report["error"], (rank, report)
        assert report["seconds"] <= PG_TIMEOUT_S + SLACK_S, (rank, report)
    assert sorted(os.listdir(dumps)) == [f"fr_rank_{r}" for r in range(4)], context
    # Once per failure: the call's group and its on-node stage group dump as one (the
    # sleeping rank's count may miss its log line: it reports once its file exists).
    writes = _dump_writes(result)
    assert writes[:SKIPPER] == [1] * SKIPPER and writes[SKIPPER] <= 1, (writes, context)
    for rank, report in sorted(result.reports.items()):
        # The healthy calls went scheduled -> started -> completed, the job-level ones too.
        calls = [h for h in report["healthy"] if h[0] == "0"]
        assert [tuple(h[1:4]) for h in calls] == [
            ("nccl:all_reduce", "completed", seq) for seq in (1, 2, 3)
        ], (rank, report["healthy"])
        assert all(started for *_, started in report["healthy"]), (rank, report["healthy"])
    output = analyze(str(dumps))
    return missed, output, result.reports


def _dump_writes(result, ranks: int = 4) -> list[int]:
    """How many times each rank wrote its dump (the recorder logs every write)."""
    logs = "\n".join(result.logs)
    return [
        len(re.findall(rf"wrote the flight recorder dump to \S*fr_rank_{r}\b", logs))
        for r in range(ranks)
    ]


def _job_level_block(output: str, missed: int) -> str:
    """The analyzer's report on the world group's missed call (up to the next report)."""
    head = f"Not all ranks joining collective, sequence number: {missed}\n"
    blocks = [b for b in output.split("Not all ranks joining") if "group info: 0:" in b]
    assert blocks and ("Not all ranks joining" + blocks[0]).startswith(head), output
    return blocks[0]


def test_rank_that_skips_an_all_reduce_on_two_nodes_is_named(tmp_path):
    missed, output, _ = _run_skip(tmp_path, check="1")
    block = _job_level_block(output, missed)
    assert f"missing ranks: {{{SKIPPER}}}" in block, output
    assert "collective: nccl:all_reduce" in block, output
    assert "collective state: started" in block, output


def test_hang_in_a_stage_between_nodes_names_its_call(tmp_path):
    # Without the check exchange the leaders' reduction between the nodes is a gloo stage:
    # rank 0 posts it, rank 2 never does (it waits on node 1 for rank 3).
    missed, output, reports = _run_skip(tmp_path, check="0")
    block = _job_level_block(output, missed)
    assert f"missing ranks: {{{SKIPPER}}}" in block, output
    assert "collective state: started" in block, output
    # Each healthy call's stage between the nodes: an entry of the leaders' gloo group,
    # numbered in that group, naming its call, completed.
    for rank in (0, 2):
        stages = [tuple(h[1:4]) for h in reports[rank]["healthy"] if h[0] == "0/cross0"]
        assert len(stages) == 3, (rank, reports[rank]["healthy"])
        for seq, (name, state, stage_seq) in enumerate(stages, start=1):
            assert re.fullmatch(
                rf"nccl:(all_to_all|all_reduce) \(stage of all_reduce seq {seq}\)", name
            ), (rank, stages)
            assert (state, stage_seq) == ("completed", seq), (rank, stages)
    stage = re.search(
        r"Not all ranks joining collective, sequence number: (\d+)\n"
        r"internal record id: \d+\n"
        r"group info: 0/cross0:[^\n]*\n"
        r"collective: nccl:(all_to_all|all_reduce) \(stage of all_reduce seq (\d+)\)\n"
        r"missing ranks: \{2\}\n",
        output,
    )
    assert stage, output
    assert stage.group(1) == "4" and int(stage.group(3)) == missed == 4, output


def test_mismatch_found_by_the_check_exchange_dumps_on_every_rank(tmp_path):
    dumps = tmp_path / "dumps"
    result = run_job(
        [2, 2],
        "mismatch_dump",
        tmp_path / "out",
        timeout=JOB_TIMEOUT,
        env={
            "SPYRECCL_MN_SKIPPER": str(SKIPPER),
            "SPYRECCL_MN_PG_TIMEOUT": "30",
            "SPYRECCL_MN_SEED": str(fresh_seed()),
            "TORCH_FR_DUMP_TEMP_FILE": str(dumps / "fr_rank_"),
        },
        stop_after_reports=4,
    )
    context = result.describe()
    assert sorted(result.reports) == [0, 1, 2, 3], context
    (missed,) = {report["missed"] for report in result.reports.values()}
    for rank, report in sorted(result.reports.items()):
        assert not report["failures"], (rank, report["failures"])
        assert report["error"] and report["error"].startswith("MismatchError"), (rank, report)
        assert report["dumped"], f"rank {rank} had no dump when its call failed; {context}"
        assert report["seconds"] <= 30 + SLACK_S, (rank, report)
    assert _dump_writes(result) == [1] * 4, context
    output = analyze(str(dumps))
    assert f"Collective sequence number: {missed} has errors" in output, output
    assert re.search(
        rf"Culprit rank {SKIPPER}; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective "
        r"type: 'all_reduce' does not match found collective type: 'broadcast'",
        output,
    ), output

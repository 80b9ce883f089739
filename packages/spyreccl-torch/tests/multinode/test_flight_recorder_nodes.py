"""The flight recorder on 2 simulated nodes x 2 ranks, read by torch's analyzer unmodified.

Rank 3 (node 1) skips one all_reduce of the world group (a hierarchical group) and sleeps
outside any collective; the others call it and fail within the group timeout. Every rank must
dump (rank 3 through the failure its node mate reports in the store), and
``python -m torch.distributed.flight_recorder.fr_trace`` over the dumps must name rank 3 and
the missed all_reduce's sequence number.
"""

from __future__ import annotations

import os

from _flight_support import analyze
from _launch import run_job

from spyreccl_testing.inputs import fresh_seed

JOB_TIMEOUT = 240.0
PG_TIMEOUT_S = 5.0
SLACK_S = 30.0
SKIPPER = 3


def test_rank_that_skips_an_all_reduce_on_two_nodes_is_named(tmp_path):
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
    output = analyze(str(dumps))
    assert f"Not all ranks joining collective, sequence number: {missed}" in output, output
    assert f"missing ranks: {{{SKIPPER}}}" in output, output
    assert "collective: nccl:all_reduce" in output, output

"""The interpreter exits cleanly while backend threads still have work ending in Python.

Python before 3.14 ends a thread that asks for the GIL during finalization with
pthread_exit; from C++ frames that aborts the process ("terminate called without an
active exception", exit code -6) after the script itself ended. spyreccl's exit hook
(spyreccl_torch/_lifecycle.py, src/backend/exit_guard.h) drains its groups before
finalization and switches guarded callbacks off. Each scenario is in _exit_scenarios.py
(real interpreter exits, so these are subprocesses, not the forked launcher, which skips
finalization).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from spyreccl_testing.scripts import RankExit, run_rank_scripts

SCRIPT = Path(__file__).with_name("_exit_scenarios.py")
ExitRun = tuple[Path, list[RankExit]]  # the scenario directory and each rank's exit


def _sum_of_inputs(directory: Path) -> float:
    inputs = [torch.load(directory / f"input{r}.pt") for r in range(2)]
    return float((inputs[0].double() + inputs[1].double()).sum())


@pytest.fixture(scope="module")
def exit_run(tmp_path_factory: pytest.TempPathFactory) -> ExitRun:
    directory = tmp_path_factory.mktemp("exit")
    exits = run_rank_scripts(
        [str(SCRIPT), str(directory)], 2, env={"OMP_NUM_THREADS": "1"}, timeout=180
    )
    return directory, exits


def _assert_exited_cleanly(exits: list[RankExit]) -> None:
    for e in exits:
        assert e.returncode == 0, f"rank {e.rank} exited with {e.returncode}:\n{e.output[-4000:]}"
        assert "terminate called" not in e.output, f"rank {e.rank}:\n{e.output[-4000:]}"


def _assert_stage_abandoned(directory: Path, name: str) -> None:
    """Both ranks made a hierarchical group; rank 1 failed before its gloo stage, rank 0
    abandoned its own on that failure (_exit_helpers.abandon_a_stage, files `<name><rank>`)."""
    for rank in range(2):
        assert (directory / f"nodes_type{rank}").read_text() == "HierarchicalProcessGroup"
    assert "injected: rank 1 fails" in (directory / f"{name}1").read_text()
    rank0 = (directory / f"{name}0").read_text()
    assert "all_reduce seq 1 failed on rank 1" in rank0, rank0


def test_both_ranks_exit_with_status_zero(exit_run: ExitRun) -> None:
    _assert_exited_cleanly(exit_run[1])


def test_guarded_callbacks_run_while_alive(exit_run: ExitRun) -> None:
    directory, _ = exit_run
    error, thread = ast.literal_eval((directory / "ok_cb").read_text())
    assert error is None and thread != "MainThread", (error, thread)
    error, thread = ast.literal_eval((directory / "failed_cb").read_text())
    assert isinstance(error, str) and "Timed out" in error, error
    assert thread != "MainThread"


def test_group_destroyed_on_its_own_progress_thread(exit_run: ExitRun) -> None:
    directory, _ = exit_run
    seen, before, after = ast.literal_eval((directory / "own_thread").read_text())
    # Dropped by a thread Python did not start (the progress thread: "Dummy-N"), and that
    # thread ended once the group was gone; the process went on (both exit codes are 0).
    assert len(seen) == 1 and seen[0] != "MainThread", seen
    assert after == before, (before, after)


def test_forked_child_exits_at_once(exit_run: ExitRun) -> None:
    directory, _ = exit_run
    assert (directory / "fork_child").read_text() == "0"


def test_pending_operation_finishes_in_the_exit_hook(exit_run: ExitRun) -> None:
    directory, _ = exit_run
    got = float((directory / "pending_result").read_text())
    assert got == pytest.approx(_sum_of_inputs(directory), rel=1e-5, abs=1e-4)


def test_guarded_callback_skipped_during_finalization(exit_run: ExitRun) -> None:
    directory, _ = exit_run
    # The peer's result shows that rank 0's gloo operation did take part (during rank 0's
    # finalization); its callback must not have run then.
    got = float((directory / "peer_late_result").read_text())
    assert got == pytest.approx(_sum_of_inputs(directory), rel=1e-5, abs=1e-4)
    assert not (directory / "late_callback_ran").exists()


def test_abandoned_multinode_stage_ended_during_finalization(exit_run: ExitRun) -> None:
    # The peer's exit ended the abandoned stage while rank 0 finalized, and rank 0 still
    # exited with status 0 (test_both_ranks_exit_with_status_zero).
    _assert_stage_abandoned(exit_run[0], "abandoned")


ABANDONED_SCRIPT = Path(__file__).with_name("_exit_abandoned_stage.py")


def test_abandoned_multinode_stage_released_across_finalization(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # torch's race at exit made deterministic (see _exit_abandoned_stage.py): gloo's thread
    # ends rank 0's abandoned stage while rank 0's last exit function holds the GIL, and
    # would release the stage's Work only once finalization began. The multi-node group
    # keeps the Work referenced, so rank 0 exits cleanly; without that it aborted in every
    # run (exit code -6).
    directory = tmp_path_factory.mktemp("abandoned")
    exits = run_rank_scripts(
        [str(ABANDONED_SCRIPT), str(directory)], 2, env={"OMP_NUM_THREADS": "1"}, timeout=120
    )
    _assert_exited_cleanly(exits)
    _assert_stage_abandoned(directory, "failed")
    # The hazard was there: a gloo stage still pending when rank 0 destroyed the group.
    assert ast.literal_eval((directory / "abandoned").read_text()) == [False]
    assert (directory / "script_done").exists() and (directory / "last_exit_function").exists()

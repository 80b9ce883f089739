"""run_rank_scripts: every rank runs to its real exit, with its own environment."""

from __future__ import annotations

from spyreccl_testing.scripts import run_rank_scripts

_SCRIPT = """
import os, sys
rank = int(os.environ["RANK"])
print("rank", rank, "of", os.environ["WORLD_SIZE"], os.environ["EXTRA"], os.environ["MASTER_PORT"])
import atexit
atexit.register(lambda: print("atexit ran", flush=True))
if os.environ.get("HANG_RANK") == str(rank):
    import time
    time.sleep(60)
sys.exit(10 + rank)
"""


def test_ranks_exit_with_their_own_codes_and_output(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT)
    exits = run_rank_scripts([str(script)], 3, env={"EXTRA": "x"}, timeout=60)
    assert [e.rank for e in exits] == [0, 1, 2]
    assert [e.returncode for e in exits] == [10, 11, 12]
    assert not any(e.hung for e in exits)
    ports = set()
    for e in exits:
        first = e.output.splitlines()[0].split()
        assert first[:5] == ["rank", str(e.rank), "of", "3", "x"], e.output
        ports.add(first[5])
        assert "atexit ran" in e.output  # a real interpreter exit
    assert len(ports) == 1  # one rendezvous for all ranks


def test_a_hung_rank_is_killed_at_the_timeout(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT)
    exits = run_rank_scripts([str(script)], 2, env={"EXTRA": "y", "HANG_RANK": "1"}, timeout=3)
    assert exits[0].returncode == 10 and not exits[0].hung
    assert exits[1].hung and exits[1].returncode == -9

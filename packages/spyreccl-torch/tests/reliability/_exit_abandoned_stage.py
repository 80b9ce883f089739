"""One rank of test_interpreter_exit.py's abandoned-stage test. Run as
``python _exit_abandoned_stage.py DIR`` with RANK and WORLD_SIZE=2 in the environment;
rank 0 is the one under test, rank 1 its peer.

Rank 0 abandons a multi-node group's gloo stage (rank 1 fails before its own), destroys the
group and ends its script. Rank 1 exits while rank 0 runs its last exit function, which
holds the GIL: gloo's thread on rank 0 then ends the stage with an error and, if nothing else
referenced the stage's Work, releases it there. Its tensor's Python object (dead, kept by
C++) needs the GIL to be released, so the thread waits for it, and gets it only once the
interpreter is finalizing, when Python ends the thread instead (pthread_exit from C++
frames: "terminate called without an active exception", exit code -6).

That is torch's race at exit, made deterministic: the last exit function is a C function
(sum), so no bytecode runs between it and the point where the runtime flags itself as
finalizing, and nothing gives the GIL away in between; a module deleted during
finalization then sleeps, which hands the GIL to the waiting thread. The multi-node group
keeps abandoned Works referenced (multinode/hierarchical.py, shutdown), so with spyreccl the
Work is not released on gloo's thread and rank 0 exits with status 0. Without that, this
script aborted in every run (2026-11-27).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from pathlib import Path

DIR = Path(sys.argv[1])
RANK = int(os.environ["RANK"])

if RANK == 0:
    # Exit functions run last-registered first: these two run after torch's and
    # spyreccl's (registered when they are imported, below). The marker tells rank 1 to
    # exit; sum() then keeps the GIL in C until finalization has begun (~0.3 s or more).
    atexit.register(sum, range(30_000_000))
    atexit.register((DIR / "last_exit_function").touch)


class _Sleeper:
    """Deleted with the modules, during finalization: releases the GIL for a moment."""

    def __del__(self) -> None:
        time.sleep(0.5)


import torch.distributed as dist  # noqa: E402
from _exit_helpers import abandon_a_stage, delete_during_finalization  # noqa: E402

store = dist.FileStore(str(DIR / "store"), 2)
dist.init_process_group("spyreccl", store=store, rank=RANK, world_size=2)

# Rank 1 fails before its gloo stage; rank 0 abandons its own (_exit_helpers.py).
nodes = abandon_a_stage(DIR, RANK, "failed")

if RANK == 0:
    # The stage rank 0 gave up on: still pending in gloo, which holds its Work.
    (DIR / "abandoned").write_text(repr([w.is_completed() for w in nodes._abandoned]))
    dist.destroy_process_group(nodes)
    del nodes
    gc.collect()
    delete_during_finalization("_spyreccl_abandon_sleeper", _Sleeper())
    (DIR / "script_done").touch()
else:
    deadline = time.monotonic() + 60
    while not (DIR / "last_exit_function").exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    # At once, without any cleanup: closing the connections is what ends rank 0's stage.
    os._exit(0)

"""What spyreccl does when the Python interpreter exits.

Before Python finalizes (an ``atexit`` hook, registered when the backend loads), every live
spyreccl group finishes the operations it queued, and callbacks on Works that are still
pending (gloo operations abandoned after a failure) are switched off. Without this, a
thread of the backend or of gloo that completes an operation during finalization asks for
the GIL, Python (before 3.14) ends that thread with ``pthread_exit``, and the forced unwind
through C++ code aborts the process ("terminate called without an active exception") after
the script itself ended normally. See ``src/backend/exit_guard.h``.

Finishing queued operations is what destroying a group does too; each wait is bounded by
the group's timeout, and an operation whose peer died fails within the peer-death delay.
"""

from __future__ import annotations

import atexit

_registered = False


def _before_exit() -> None:
    from . import _C
    from .multinode import hierarchical

    hierarchical.shut_down_live_groups()  # their threads stop using the node groups first
    _C._prepare_for_exit()


def register_exit_hook() -> None:
    """Registers the exit hook once (atexit hooks run in reverse order of registration, so
    a program's own hooks, registered after ``import torch``, run before this one and may
    still use their groups)."""
    global _registered
    if not _registered:
        atexit.register(_before_exit)
        _registered = True

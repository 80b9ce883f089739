"""What the flight recorder tests share: torch's analyzer run over a folder of dumps."""

from __future__ import annotations

import os
import subprocess
import sys


def analyze(folder: str) -> str:
    """torch's analyzer (`torchfrtrace`), unmodified, over `folder`: everything it prints (its
    report goes to stderr). Fails the test when the analyzer itself fails."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", folder],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output

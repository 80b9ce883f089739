"""``LOCAL_RANK`` selects the process's spyre device, as in torch-spyre's runtime.

Each case runs a fresh interpreter with the variable set: it is read once per process.
``import torch`` must always work; an invalid ``LOCAL_RANK`` fails at device
initialisation (first spyre tensor, first device query) with an error that starts with
torch-spyre's exact wording for the case and then names the variable, its value and the
valid range.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spyreccl_torch import device as spyre_device

pytestmark = pytest.mark.skipif(
    not spyre_device.register(), reason="the emulated spyre device stepped aside"
)

_PYTHON = sys.executable


def _run(code: str, env: dict[str, str | None], timeout: float = 120):
    """Runs `code` in a fresh interpreter with `env` applied (None: unset)."""
    full_env = {k: v for k, v in os.environ.items() if k not in env}
    full_env.update({k: v for k, v in env.items() if v is not None})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [_PYTHON, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


_VALID = """
    import threading
    import torch

    expected = int(EXPECTED)
    assert torch.spyre.current_device() == expected, torch.spyre.current_device()
    assert torch.accelerator.current_device_index() == expected
    x = torch.ones(3, device="spyre")
    assert x.device == torch.device("spyre", expected), x.device
    y = torch.arange(4.0).to("spyre")
    assert y.device.index == expected and y.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]

    # Every thread starts on the process's device; set_device is per thread.
    seen = []
    def worker():
        seen.append(torch.spyre.current_device())
        torch.spyre.set_device(0)
        seen.append(torch.empty(1, device="spyre").device.index)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [expected, 0], seen
    assert torch.spyre.current_device() == expected
    with torch.spyre.device(1):
        assert torch.empty(1, device="spyre").device.index == 1
    assert torch.spyre.current_device() == expected
    print("OK", expected)
"""


@pytest.mark.parametrize(
    ("local_rank", "count", "expected"),
    [
        (None, None, 0),
        ("", None, 0),
        ("3", None, 3),
        ("0", "2", 0),
        ("3", "4", 3),
        (" 2 ", None, 2),
    ],
    ids=["unset", "empty", "3-of-8", "0-of-2", "last-of-4", "spaces"],
)
def test_valid_local_rank_selects_the_device(local_rank, count, expected):
    result = _run(
        _VALID.replace("EXPECTED", str(expected)),
        {"LOCAL_RANK": local_rank, "SPYRECCL_SPYRE_DEVICE_COUNT": count},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["OK", str(expected)]


_INVALID = """
    import torch  # must not fail
    print("imported", flush=True)
    assert torch.spyre.device_count() == COUNT  # queries that need no device still work
    assert torch.spyre.is_available()
    for attempt in range(2):  # a failed initialisation fails again on the next use
        try:
            torch.ones(1, device="spyre")
        except RuntimeError as error:
            print("ERROR", error, flush=True)
        else:
            raise AssertionError("an invalid LOCAL_RANK was accepted")
    try:
        torch.spyre.current_device()
    except RuntimeError as error:
        print("ERROR", error, flush=True)
    else:
        raise AssertionError("current_device accepted an invalid LOCAL_RANK")
"""


@pytest.mark.parametrize(
    ("local_rank", "count", "prefix", "explanation"),
    [
        # Each message starts with torch-spyre's exact wording for the case (programs and
        # torch-spyre's own tests match on it), then gives ours.
        ("invalid", "8", "LOCAL_RANK is not a valid integer: 'invalid'. ", "0 <= LOCAL_RANK < 8"),
        ("abc", "8", "LOCAL_RANK is not a valid integer: 'abc'. ", "0 <= LOCAL_RANK < 8"),
        ("1.5", "8", "LOCAL_RANK is not a valid integer: '1.5'. ", "0 <= LOCAL_RANK < 8"),
        ("-1", "8", "LOCAL_RANK value is out of range: -1. ", "0 <= LOCAL_RANK < 8"),
        (
            "99999999999999999999",
            "8",
            "LOCAL_RANK value is out of range: 99999999999999999999. ",
            "0 <= LOCAL_RANK < 8",
        ),
        (
            "128",
            "8",
            "LOCAL_RANK value 128 exceeds the maximum supported device index (127). ",
            "0 <= LOCAL_RANK < 8",
        ),
        (
            "128",
            "127",
            "LOCAL_RANK value 128 exceeds the maximum supported device index (127). ",
            "0 <= LOCAL_RANK < 127",
        ),
        ("8", "8", "Device index out of bounds. ", "number of visible devices=8"),
        ("4", "4", "Device index out of bounds. ", "number of visible devices=4"),
        ("127", "8", "Device index out of bounds. ", "number of visible devices=8"),
    ],
)
def test_invalid_local_rank_fails_at_device_initialisation(local_rank, count, prefix, explanation):
    result = _run(
        _INVALID.replace("COUNT", count),
        {"LOCAL_RANK": local_rank, "SPYRECCL_SPYRE_DEVICE_COUNT": count},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "imported"
    errors = [line for line in lines if line.startswith("ERROR")]
    assert len(errors) == 3, result.stdout
    for line in errors:
        message = line.removeprefix("ERROR ")
        assert message.startswith(prefix), message
        # Our explanation follows: the variable as given and the valid range.
        assert f"LOCAL_RANK='{local_rank}'" in message, message
        assert explanation in message, message


_TORCHRUN_SCRIPT = """
import os
import torch

local_rank = int(os.environ["LOCAL_RANK"])
x = torch.full((2,), float(local_rank), device="spyre")
print(f"rank {local_rank}: current {torch.spyre.current_device()} tensor {x.device}", flush=True)
"""


def test_torchrun_processes_run_on_their_local_rank(tmp_path: Path):
    script = tmp_path / "which_device.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run(
        [
            _PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            str(script),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The ranks share torchrun's stdout: their lines can interleave without a newline between.
    lines = sorted(re.findall(r"rank \d+: current \d+ tensor spyre:\d+", result.stdout))
    assert lines == [f"rank {r}: current {r} tensor spyre:{r}" for r in range(3)], result.stdout

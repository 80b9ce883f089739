"""SPYRECCL_SPYRE_MEMORY: the emulated device's memory model.

``discrete`` makes a spyre tensor's ``data_ptr()`` a device address that the host cannot read
(as on real Spyre cards) while every torch operation stays correct. Each scenario runs in a
fresh interpreter with the variable set, whatever this process's mode: a fault must kill the
child, and the mode is read once per process. Inputs are fresh random values (the seed is
printed); results are compared with the same computation on CPU in float64.
"""

from __future__ import annotations

import signal

import pytest
from test_device import assert_fresh_ok, run_fresh

from spyreccl_testing.inputs import fresh_seed
from spyreccl_torch import device as spyre_device

pytestmark = pytest.mark.skipif(
    not spyre_device.register(), reason="the emulated spyre device stepped aside"
)

ENV = "SPYRECCL_SPYRE_MEMORY"
FAULTS = (-signal.SIGSEGV, -signal.SIGBUS)

# Reads the first 4 bytes of a spyre tensor through ctypes at its data_ptr(); prints the mode,
# the expected bytes (through the device's copy to CPU) and then what the read returned.
_READ_DATA_PTR = """
import ctypes
import numpy as np
import torch

cpu = torch.from_numpy(np.random.default_rng({seed}).standard_normal({numel}))
t = cpu.to("spyre")
print(torch.spyre.memory_mode(), cpu[:1].numpy().tobytes()[:4].hex(), flush=True)
print(ctypes.string_at(t.data_ptr(), 4).hex(), flush=True)
"""


@pytest.mark.parametrize("numel", [3, 1 << 14], ids=["small-block", "large-block"])
@pytest.mark.parametrize("mode", ["host", "discrete"])
def test_reading_data_ptr_from_the_host_faults_only_in_discrete_mode(mode, numel):
    seed = fresh_seed()
    print(f"seed {seed}")
    result = run_fresh(_READ_DATA_PTR.format(seed=seed, numel=numel), **{ENV: mode})
    lines = result.stdout.split("\n")
    reported_mode, expected = lines[0].split()
    assert reported_mode == mode, result.stderr
    if mode == "host":
        assert result.returncode == 0, result.stderr
        assert lines[1] == expected
    else:
        assert result.returncode in FAULTS, (result.returncode, result.stdout, result.stderr)
        assert lines[1] == "", "the read returned instead of faulting"


def test_unknown_value_warns_by_name_and_uses_host_memory():
    out = assert_fresh_ok(
        run_fresh(
            """
            import ctypes, torch
            import spyreccl_torch.device as d
            t = torch.full((2,), 7, dtype=torch.int32, device="spyre")
            raw = ctypes.string_at(t.data_ptr(), 4)
            print(torch.spyre.memory_mode(), d.memory_mode(), raw.hex())
            """,
            **{ENV: "gpu"},
        )
    )
    assert out.split() == ["host", "host", "07000000"]


@pytest.mark.parametrize("value", ["discrete", " Discrete ", "host", ""])
def test_valid_values_import_torch_silently(value):
    result = run_fresh("import torch; print(torch.spyre.memory_mode())", **{ENV: value})
    out = assert_fresh_ok(result)
    assert out.split() == ["discrete" if "iscrete" in value else "host"]
    assert result.stderr == ""


def _memory_mode_case() -> str:  # module level: rank workers import it by name
    import torch

    return torch.spyre.memory_mode()


def test_rank_pools_pass_the_memory_mode_to_their_ranks(make_pool):
    # Spawned ranks inherit the test process's environment (so `SPYRECCL_SPYRE_MEMORY=discrete
    # pytest ...` puts every rank in discrete mode), and a pool's env= chooses for its ranks.
    inherited = make_pool(2, distributed=False, start_method="spawn")
    assert inherited.run(_memory_mode_case) == [spyre_device.memory_mode()] * 2
    chosen = make_pool(2, distributed=False, start_method="spawn", env={ENV: "discrete"})
    assert chosen.run(_memory_mode_case) == ["discrete"] * 2


_DISCRETE_OPERATIONS = """
import os
import numpy as np
import torch
import spyreccl_torch.device as d

assert torch.spyre.memory_mode() == d.memory_mode() == "discrete"
rng = np.random.default_rng({seed})
def rand(*shape):
    return torch.from_numpy(rng.standard_normal(shape))

def check(name, got, expected):
    assert got.device.type == "spyre", (name, got.device)
    got = got.cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape, (name, got, expected)
    assert torch.equal(got, expected), (name, got, expected)

a, b = rand(33, 17), rand(33, 17)
sa, sb = a.to("spyre"), b.to("spyre")
big = rand(70_000)  # large-block pool
sbig = big.to("spyre")
# The fallback's fresh results, views, in-place and out= (a resized output) kernels.
check("add", sa + sb, a + b)
check("sum", sa.sum(0), a.sum(0))
check("matmul", sa @ sb.t(), a @ b.t())
check("sin", sbig.sin(), big.sin())
check("view", sa.t()[3:9:2], a.t()[3:9:2])
c = rand(8, 2)
check("view_as_real", torch.view_as_real(torch.view_as_complex(c.to("spyre"))), c)
sa2 = sa.clone(); sa2.mul_(sb); check("mul_", sa2, a * b)
out = torch.empty(0, dtype=torch.float64, device="spyre")
torch.add(sa, sb, out=out); check("add out= resized", out, a + b)
s = sa.clone(); s.resize_(40, 17); check("resize_ keeps the prefix", s[:33], a)
check("index_select", sa.index_select(0, torch.tensor([5, 0, 32]).to("spyre")), a[[5, 0, 32]])
filled = torch.empty(5, dtype=torch.float64, device="spyre").fill_(2.5)
check("fill_", filled, torch.full((5,), 2.5, dtype=torch.float64))
assert sa[2, 3].item() == a[2, 3].item()
# Copies the backend stages through: spyre <-> pinned host tensors, blocking or not.
pinned = torch.empty_like(big).pin_memory()
pinned.copy_(sbig, non_blocking=True); torch.spyre.synchronize()
assert torch.equal(pinned, big)
back = torch.empty_like(sbig); back.copy_(pinned.mul_(2), non_blocking=True)
check("pinned -> spyre", back, big * 2)
check("spyre -> spyre", torch.empty_like(sbig).copy_(sbig), big)
check("dtype conversion", sa.float(), a.float())
# The device's own random kernels and host_view.
torch.spyre.manual_seed(3)
n = torch.empty(50_000, dtype=torch.float64, device="spyre").normal_().cpu()
assert abs(float(n.mean())) < 0.05 and abs(float(n.std()) - 1) < 0.05
p = torch.rand(1000, dtype=torch.float64).to("spyre")
draw = torch.bernoulli(p).cpu()
assert set(draw.unique().tolist()) <= {{0.0, 1.0}}
view = d.host_view(sa)
assert view.data_ptr() != sa.data_ptr() and torch.equal(view, a)
view.add_(1); check("write through host_view", sa, a + 1)
# Memory statistics count discrete blocks as host-mode blocks.
before = torch.spyre.memory_allocated(0)
x = torch.empty(1 << 20, dtype=torch.uint8, device="spyre:0")
assert torch.spyre.memory_allocated(0) - before == 1 << 20
del x
# A forked child gets a private copy: its writes never reach the parent's tensor.
pid = os.fork()
if pid == 0:
    sbig.fill_(-1.0)
    os._exit(0 if bool((sbig.cpu() == -1.0).all()) else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
check("parent after fork", sbig, big)
print("ok")
"""


def test_every_kind_of_device_code_is_correct_in_discrete_mode():
    seed = fresh_seed()
    print(f"seed {seed}")
    # One intra-op thread: torch's OpenMP pool does not survive fork() (the child's first
    # parallel kernel hangs, in host mode too).
    code = _DISCRETE_OPERATIONS.format(seed=seed)
    out = assert_fresh_ok(run_fresh(code, OMP_NUM_THREADS="1", **{ENV: "discrete"}))
    assert out.split() == ["ok"]

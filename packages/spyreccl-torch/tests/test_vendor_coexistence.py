"""spyreccl beside a vendor package that registers ``spyre`` and a ``spyreccl`` backend, as
IBM's torch-spyre does, in both autoload orders.

The vendor is tests/vendor_standin/torch_spyre: it registers exactly as torch-spyre does (a
``torch.backends`` entry point ``torch_spyre = torch_spyre:_autoload``; importing it registers
the device, then calls ``dist.Backend.register_backend("spyreccl", creator,
devices=["spyre"])``), and it provides the ``spyre`` device itself, as torch-spyre's runtime
would, using spyreccl's emulated-device library as its runtime (no card here). So the
situation each test meets is the real one: a real runtime is installed, spyreccl's
emulation steps aside, and the device and the ``spyreccl`` name belong to the vendor. Its
backend implements torch-spyre's operation set only (see its docstring) and records the
calls it serves.

It is installed by putting a directory with the package and a ``torch_spyre-0.0.0.dist-info``
(METADATA, entry_points.txt) on ``PYTHONPATH``. torch calls the entry points in the order
``importlib.metadata`` finds distributions: by ``sys.path`` entry, first entry first. So:

* vendor first: PYTHONPATH = vendor dir (it precedes site-packages, where spyreccl-torch is);
* ours first: PYTHONPATH = ours:vendor, where ours holds only a copy of spyreccl-torch's own
  dist-info (its entry point; the package itself stays in site-packages), found first.

Every job asserts the order that actually happened (the entry points' order, and whether
``spyreccl_torch`` was loaded when the vendor's registration ran).

Each rank is a fresh interpreter started here (tests/_vendor_jobs.py), not a rank pool: the
thing under test happens at ``import torch``, in an order decided by the interpreter's
``sys.path``, and a pool's workers inherit the test process's ``sys.path`` and autoload.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import pytest
import torch

from spyreccl_testing.accuracy import assert_close_dtype, gloo_tolerance, reference_reduce
from spyreccl_testing.seeds import fresh_seed

_TESTS = Path(__file__).parent
_JOBS = _TESTS / "_vendor_jobs.py"
_OURS = "spyreccl_torch._registration._create"
_VENDORS = "torch_spyre._create"
_SWITCHES = ("SPYRECCL_OVERRIDE_VENDOR", "SPYRECCL_ROUTE_TO_VENDOR")


@pytest.fixture(scope="module")
def orders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PYTHONPATH for each autoload order."""
    root = tmp_path_factory.mktemp("vendor")
    vendor = root / "vendor"
    shutil.copytree(_TESTS / "vendor_standin" / "torch_spyre", vendor / "torch_spyre")
    info = vendor / "torch_spyre-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-spyre\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[torch.backends]\ntorch_spyre = torch_spyre:_autoload\n"
    )
    ours_dist = distribution("spyreccl-torch")
    ours = root / "ours" / f"spyreccl_torch-{ours_dist.version}.dist-info"
    ours.mkdir(parents=True)
    (ours / "METADATA").write_text(ours_dist.read_text("METADATA") or "")
    (ours / "entry_points.txt").write_text(ours_dist.read_text("entry_points.txt") or "")
    return {"vendor-first": str(vendor), "ours-first": f"{ours.parent}{os.pathsep}{vendor}"}


def _env(pythonpath: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SWITCHES}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env.pop("LOCAL_RANK", None)
    inherited = env.get("PYTHONPATH")
    env["PYTHONPATH"] = pythonpath + (os.pathsep + inherited if inherited else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _launch(
    job: str, world: int, pythonpath: str, tmp_path: Path, seed: int, **extra: str
) -> list[dict[str, Any]]:
    """Runs `job` on `world` fresh ranks; returns what each saved."""
    procs = []
    for rank in range(world):
        env = _env(
            pythonpath,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            JOB_STORE=str(tmp_path / "store"),
            JOB_SEED=str(seed),
            **extra,
        )
        out = tmp_path / f"rank{rank}.pt"
        command = [sys.executable, str(_JOBS), job, str(out)]
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    reports = []
    try:
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=300)
            reports.append(f"rank {rank} rc={proc.returncode}\n{stdout}\n{stderr[-4000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [r for p, r in zip(procs, reports, strict=True) if p.returncode != 0]
    assert not failed, "\n".join(failed)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_order(registry: dict[str, Any], order: str) -> None:
    names = registry["entry_points"]
    vendor_first = names.index("torch_spyre") < names.index("spyreccl")
    assert vendor_first == (order == "vendor-first"), names
    # The vendor's registration ran before/after our package was loaded.
    assert registry["vendor_saw_spyreccl_torch"] == (order == "ours-first"), registry


@pytest.mark.parametrize("override", ["", "1"], ids=["default", "override"])
@pytest.mark.parametrize("order", ["vendor-first", "ours-first"])
def test_import_torch_is_silent(orders: dict[str, str], order: str, override: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env=_env(orders[order], SPYRECCL_OVERRIDE_VENDOR=override),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == "", (result.stdout, result.stderr)


# (order, SPYRECCL_OVERRIDE_VENDOR) -> (init_process_group backend, new_group backend,
# expected kinds of the two groups, creator behind spyreccl, backend_name()).
_NAME_CASES = {
    ("vendor-first", ""): (
        "cpu:gloo,spyre:spyreccl_shm",
        "spyreccl",
        ("spyreccl", "vendor"),
        _VENDORS,
        "spyreccl_shm",
    ),
    ("ours-first", ""): (
        "cpu:gloo,spyre:spyreccl",
        "spyreccl_shm",
        ("vendor", "spyreccl"),
        _VENDORS,
        "spyreccl_shm",
    ),
    # The switch: ours is spyre's default (init_process_group() without a backend) and the
    # one behind "spyreccl", in either order.
    ("vendor-first", "1"): ("", "spyreccl", ("spyreccl", "spyreccl"), _OURS, "spyreccl"),
    ("ours-first", "1"): ("", "spyreccl", ("spyreccl", "spyreccl"), _OURS, "spyreccl"),
}


@pytest.mark.parametrize("override", ["", "1"], ids=["default", "override"])
@pytest.mark.parametrize("order", ["vendor-first", "ours-first"])
def test_names_reach_the_right_backend(
    orders: dict[str, str], tmp_path: Path, order: str, override: str
) -> None:
    init, sub, kinds, behind_spyreccl, name = _NAME_CASES[(order, override)]
    seed = fresh_seed()
    world = 2
    ranks = _launch(
        "names",
        world,
        orders[order],
        tmp_path,
        seed,
        JOB_INIT=init,
        JOB_SUB=sub,
        SPYRECCL_OVERRIDE_VENDOR=override,
    )
    for rank, saved in enumerate(ranks):
        registry = saved["registry"]
        _assert_order(registry, order)
        assert registry["creators"] == {"spyreccl": behind_spyreccl, "spyreccl_shm": _OURS}
        assert registry["default_spyre"] == "spyreccl"
        assert registry["backend_name"] == name
        # The vendor provides the device; the emulation stepped aside.
        assert registry["emulated_device"] is False and registry["privateuse1"] == "spyre"
        job = saved["job"]
        assert (job["init"]["kind"], job["sub"]["kind"]) == kinds, (rank, job)
    for label in ("init", "sub"):
        inputs = [saved["job"][label]["inputs"] for saved in ranks]
        expected = reference_reduce(inputs, "sum", torch.float32)
        for rank, saved in enumerate(ranks):
            result = saved["job"][label]
            assert_close_dtype(
                result["output"],
                expected,
                torch.float32,
                world,
                seed=seed,
                what=f"{order}/{label} all_reduce on rank {rank}",
            )
            if "reduce_scatter" in result:
                rs_inputs = [s["job"][label]["reduce_scatter"]["inputs"] for s in ranks]
                total = reference_reduce(rs_inputs, "sum", torch.float32)
                assert_close_dtype(
                    result["reduce_scatter"]["output"],
                    total[rank * 7 : (rank + 1) * 7],
                    torch.float32,
                    world,
                    seed=seed,
                    what=f"{order}/{label} reduce_scatter on rank {rank}",
                )


# operation -> (the backend that must run it, the c10d method it arrives as).
_ROUTES: dict[str, tuple[str, str]] = {
    "all_reduce_sum": ("vendor", "allreduce"),
    "all_reduce_sum_int64": ("vendor", "allreduce"),
    "all_reduce_sum_bfloat16": ("vendor", "allreduce"),
    "all_reduce_sum_empty": ("vendor", "allreduce"),
    "all_reduce_max": ("spyreccl", "allreduce"),
    "all_reduce_avg": ("spyreccl", "allreduce"),
    "all_reduce_product_int64": ("spyreccl", "allreduce"),
    "broadcast": ("vendor", "broadcast"),
    "all_gather": ("vendor", "allgather"),
    "gather": ("vendor", "gather"),
    "reduce_sum": ("vendor", "reduce"),
    "reduce_max": ("spyreccl", "reduce"),
    "barrier": ("vendor", "barrier"),
    "scatter": ("spyreccl", "scatter"),
    "reduce_scatter": ("spyreccl", "_reduce_scatter_base"),
    "all_gather_into_tensor": ("spyreccl", "_allgather_base"),
    "all_to_all_single": ("spyreccl", "alltoall_base"),
    "funcol_all_reduce": ("vendor", "allreduce"),
    # torch's functional collectives call the tensor-coalesced forms with one tensor.
    "funcol_reduce_scatter": ("spyreccl", "reduce_scatter_tensor_coalesced"),
    "funcol_all_gather": ("spyreccl", "allgather_into_tensor_coalesced"),
    "cpu_all_reduce": ("gloo", "allreduce"),
}
_CHANNEL = {name: channel for name, (channel, _) in _ROUTES.items()} | {"sub": "vendor"}


def _check_reduction(ranks, name, op, dtype, world, seed, rank_filter=None) -> None:
    inputs = [saved["job"][name]["inputs"] for saved in ranks]
    expected = reference_reduce(inputs, op, dtype)
    # The stand-in vendor reduces with gloo, which rounds 16-bit floats after every partial
    # sum: its budget (ours rounds once; that is checked where ours runs).
    tolerance = gloo_tolerance(dtype, world, op) if _CHANNEL[name] == "vendor" else {}
    for rank, saved in enumerate(ranks):
        if rank_filter is not None and rank != rank_filter:
            continue
        assert_close_dtype(
            saved["job"][name]["output"],
            expected,
            dtype,
            world,
            seed=seed,
            what=f"{name} on rank {rank}",
            **tolerance,
        )


@pytest.mark.parametrize(
    ("world", "order"), [(2, "vendor-first"), (3, "ours-first")], ids=["ws2", "ws3"]
)
def test_routing_completes_the_vendor_backend(
    orders: dict[str, str], tmp_path: Path, world: int, order: str
) -> None:
    """SPYRECCL_ROUTE_TO_VENDOR=1: a spyreccl_shm group hands torch-spyre's operations to
    the vendor's backend and runs the rest itself. Per operation: which backend ran it
    (the router's count and the vendor's own record) and the numbers."""
    seed = fresh_seed()
    ranks = _launch(
        "routing",
        world,
        orders[order],
        tmp_path,
        seed,
        JOB_INIT="cpu:gloo,spyre:spyreccl_shm",
        SPYRECCL_ROUTE_TO_VENDOR="1",
    )
    for rank, saved in enumerate(ranks):
        _assert_order(saved["registry"], order)
        job = saved["job"]
        assert job["kind"] == "routing"
        for name, (channel, method) in _ROUTES.items():
            assert job[name]["routes"] == {(method, channel): 1}, (rank, name, job[name]["routes"])
            vendor_calls = [method] if channel == "vendor" else []
            assert job[name]["vendor_calls"] == vendor_calls, (rank, name)
        p2p = {0: ["send", "recv"], 1: ["recv", "send"]}.get(rank, [])
        assert job["send_recv"]["vendor_calls"] == p2p
        assert job["send_recv"]["routes"] == {(op, "vendor"): 1 for op in p2p}
        both = {("allreduce", "spyreccl"): 1, ("allreduce", "vendor"): 1}
        assert job["async_max_then_sum"]["routes"] == both
        assert job["async_max_then_sum"]["vendor_calls"] == ["allreduce"]
        assert job["sub"]["kind"] == "routing"
        assert job["sub"]["routes"] == {("allreduce", "vendor"): 1}
        assert job["sub"]["vendor_calls"] == ["allreduce"]

    f32, i64 = torch.float32, torch.int64
    assert all(saved["job"]["cpu_all_reduce"]["output"].device.type == "cpu" for saved in ranks)
    _check_reduction(ranks, "all_reduce_sum", "sum", f32, world, seed)
    _check_reduction(ranks, "all_reduce_sum_int64", "sum", i64, world, seed)
    _check_reduction(ranks, "all_reduce_sum_bfloat16", "sum", torch.bfloat16, world, seed)
    _check_reduction(ranks, "all_reduce_sum_empty", "sum", f32, world, seed)
    _check_reduction(ranks, "all_reduce_max", "max", f32, world, seed)
    _check_reduction(ranks, "all_reduce_avg", "avg", f32, world, seed)
    _check_reduction(ranks, "all_reduce_product_int64", "product", i64, world, seed)
    _check_reduction(ranks, "reduce_sum", "sum", f32, world, seed, rank_filter=0)
    _check_reduction(ranks, "reduce_max", "max", f32, world, seed, rank_filter=world - 1)
    _check_reduction(ranks, "funcol_all_reduce", "sum", f32, world, seed)
    _check_reduction(ranks, "sub", "sum", f32, world, seed)
    _check_reduction(ranks, "cpu_all_reduce", "sum", f32, world, seed)

    job = [saved["job"] for saved in ranks]
    inputs = {name: [j[name].get("inputs") for j in job] for name in job[0] if name != "kind"}
    src = job[0]["broadcast"]["src"]
    for rank in range(world):
        assert torch.equal(job[rank]["broadcast"]["output"], inputs["broadcast"][src])
        assert torch.equal(job[rank]["all_gather"]["output"], torch.stack(inputs["all_gather"]))
        for name in ("all_gather_into_tensor", "funcol_all_gather"):
            assert torch.equal(job[rank][name]["output"], torch.cat(inputs[name])), name
        assert torch.equal(job[rank]["scatter"]["output"], job[0]["scatter"]["inputs"][rank])
        expected_a2a = torch.cat(
            [x[rank * 5 : (rank + 1) * 5] for x in inputs["all_to_all_single"]]
        )
        assert torch.equal(job[rank]["all_to_all_single"]["output"], expected_a2a)
        for name, part in (("reduce_scatter", 333), ("funcol_reduce_scatter", 11)):
            total = reference_reduce(inputs[name], "sum", f32)
            assert_close_dtype(
                job[rank][name]["output"],
                total[rank * part : (rank + 1) * part],
                f32,
                world,
                seed=seed,
                what=f"{name} on rank {rank}",
            )
        # MAX (ours, asynchronous) finished before SUM (the vendor's) read the tensor.
        peak = reference_reduce(inputs["async_max_then_sum"], "max", f32)
        assert_close_dtype(
            job[rank]["async_max_then_sum"]["output"],
            reference_reduce([peak] * world, "sum", f32),
            f32,
            world,
            seed=seed,
            what=f"async MAX then SUM on rank {rank}",
        )
    assert torch.equal(job[0]["gather"]["output"], torch.stack(inputs["gather"]))
    assert torch.equal(job[0]["send_recv"]["output"], inputs["send_recv"][1])
    assert torch.equal(job[1]["send_recv"]["output"], inputs["send_recv"][0])

"""Registration and autoload of the spyreccl backend, each check in a fresh interpreter
(autoload happens once per process, at `import torch`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    env.update(env_overrides)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def test_import_torch_autoloads_device_and_backend() -> None:
    out = _run(
        """
        import sys
        import torch
        import torch.distributed as dist
        assert "spyreccl_torch" in sys.modules, "the torch.backends entry point did not run"
        assert dist.get_default_backend_for_device("spyre") == "spyreccl"
        assert dist.Backend.SPYRECCL == "spyreccl"
        assert "spyre" in dist.Backend.backend_capability["spyreccl"]
        assert torch.empty(3, device="spyre").device.type == "spyre"
        print("ok")
        """
    )
    assert out.stdout.strip().endswith("ok")


def test_register_is_idempotent() -> None:
    _run(
        """
        import torch.distributed as dist
        import spyreccl_torch
        creator = dist.Backend._plugins["SPYRECCL"].creator_fn
        spyreccl_torch.register()
        spyreccl_torch.register()
        assert dist.Backend._plugins["SPYRECCL"].creator_fn is creator
        assert spyreccl_torch.is_registered()
        assert dist.Backend.backend_list.count("spyreccl") == 1
        """
    )


def test_autoload_disabled_then_explicit_import() -> None:
    _run(
        """
        import sys
        import torch
        import torch.distributed as dist
        assert "spyreccl_torch" not in sys.modules, "autoload ran despite the opt-out"
        assert "SPYRECCL" not in dist.Backend._plugins
        import spyreccl_torch
        assert dist.get_default_backend_for_device("spyre") == "spyreccl"
        assert spyreccl_torch.ProcessGroupSpyreccl.Options().timeout.total_seconds() == 1800
        """,
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )


def test_autoload_failure_only_warns() -> None:
    # A loader that fails stands in for a broken installation (e.g. a missing
    # libspyreccl.so): `import torch` must still succeed, with a warning naming the cause.
    out = _run(
        """
        import sys, types, warnings
        broken = types.ModuleType("spyreccl_torch._loader")
        def load_extension():
            raise ImportError("injected: libspyreccl.so not found")
        broken.load_extension = load_extension
        sys.modules["spyreccl_torch._loader"] = broken
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch
        messages = [str(w.message) for w in caught if "spyreccl" in str(w.message)]
        assert any("injected: libspyreccl.so not found" in m for m in messages), messages
        assert "spyreccl_torch" not in sys.modules, "the half-initialised package was kept"
        # An explicit import retries and raises the real error...
        sys.modules["spyreccl_torch._loader"] = broken
        try:
            import spyreccl_torch
        except ImportError as error:
            assert "injected" in str(error)
        else:
            raise AssertionError("explicit import did not raise")
        # ...and works once the installation is fixed.
        for name in [n for n in sys.modules if n.startswith("spyreccl_torch")]:
            del sys.modules[name]
        import spyreccl_torch
        import torch.distributed as dist
        assert dist.get_default_backend_for_device("spyre") == "spyreccl"
        print("ok")
        """
    )
    assert out.stdout.strip().endswith("ok")


def test_build_records_the_torch_it_was_built_against() -> None:
    _run(
        """
        import torch
        from spyreccl_torch import _build_info
        assert _build_info.TORCH_VERSION == torch.__version__, (
            _build_info.TORCH_VERSION, torch.__version__)
        """
    )


def test_another_torch_than_the_build_only_warns_at_import_torch() -> None:
    # A build record naming another torch stands in for a torch upgraded after the build:
    # `import torch` still succeeds and warns with both versions and the rebuild command;
    # an explicit import raises the same; nothing of the backend is registered.
    out = _run(
        """
        import sys, types, warnings
        def fake_build(version):
            info = types.ModuleType("spyreccl_torch._build_info")
            info.TORCH_VERSION = version
            sys.modules["spyreccl_torch._build_info"] = info
        fake_build("2.9.1+cu128")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch
        messages = [str(w.message) for w in caught if "spyreccl" in str(w.message)]
        expected = (f"built against torch 2.9.1+cu128 but torch {torch.__version__} is "
                    "installed")
        assert any(expected in m for m in messages), messages
        assert any("pip install --no-build-isolation" in m for m in messages), messages
        assert any("torch==2.9.1" in m for m in messages), messages
        assert "spyreccl_torch" not in sys.modules
        import torch.distributed as dist
        assert "SPYRECCL" not in dist.Backend._plugins
        fake_build("2.9.1+cu128")
        try:
            import spyreccl_torch
        except ImportError as error:
            assert expected in str(error), error
        else:
            raise AssertionError("explicit import did not raise")
        print("ok")
        """
    )
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("backend", [None, "cpu:gloo,spyre:spyreccl"])
def test_init_process_group_routes_spyre_tensors(backend) -> None:
    _run(
        f"""
        import os, tempfile
        import torch, torch.distributed as dist
        path = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group(backend={backend!r}, init_method="file://" + path,
                                rank=0, world_size=1)
        t = torch.arange(4, dtype=torch.float32, device="spyre")
        dist.all_reduce(t)
        assert t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        pg = dist.group.WORLD
        name = pg._get_backend(torch.device("spyre")).name()
        assert name == "spyreccl", name
        if {backend!r} is not None:
            assert pg._get_backend(torch.device("cpu")).name() == "gloo"
            c = torch.ones(2)
            dist.all_reduce(c)
            assert c.tolist() == [1.0, 1.0]
        dist.barrier()
        dist.destroy_process_group()
        """
    )


def test_options_yield_ns() -> None:
    """Options.yield_ns: how long the group's waits yield the CPU before they sleep (the
    core's yieldNs); -1, the default, leaves it to the core (SPYRECCL_YIELD_NS or 2 ms)."""
    import spyreccl_torch

    options = spyreccl_torch.ProcessGroupSpyreccl.Options()
    assert options.yield_ns == -1
    options.yield_ns = 50_000
    assert options.yield_ns == 50_000 and "yield_ns=50000" in repr(options)
    assert options.__copy__().yield_ns == 50_000
    with pytest.raises(ValueError, match=r"Options\.yield_ns must be >= 0 \(ns\) or -1"):
        options.yield_ns = -2
    assert options.yield_ns == 50_000
    # The calling thread's override (spyrecclSetThreadYield): -1 restores the groups' own.
    from spyreccl_torch import _C

    _C._set_thread_yield_ns(0)
    _C._set_thread_yield_ns(-1)
    with pytest.raises(ValueError, match="argument 'yieldNs' = -2 must be >= 0"):
        _C._set_thread_yield_ns(-2)


# --- beside another package's backend (no vendor package needed: registered in-process) ----
# The full situation, a vendor package autoloaded before or after ours, is in
# test_vendor_coexistence.py; these check the registry's bookkeeping directly.

_FOREIGN = """
import os, tempfile
import torch, torch.distributed as dist
import spyreccl_torch
from spyreccl_torch import _registration

def foreign(store, rank, size, timeout):
    raise AssertionError("the foreign creator must not be called here")

def creator(name):
    plugin = dist.Backend._plugins.get(name.upper())
    return plugin.creator_fn if plugin is not None else None

def all_reduce_through(name):
    path = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group(backend=name, init_method="file://" + path, rank=0, world_size=1)
    pg = dist.group.WORLD
    assert isinstance(pg._get_backend(torch.device("spyre")), spyreccl_torch.ProcessGroupSpyreccl)
    t = torch.tensor([1.5, -2.0, 3.25], device="spyre")
    dist.all_reduce(t)
    assert t.cpu().tolist() == [1.5, -2.0, 3.25]
    dist.destroy_process_group()
"""


def test_a_later_foreign_spyreccl_wins_and_ours_steps_aside() -> None:
    out = _run(
        _FOREIGN
        + """
assert creator("spyreccl") is _registration._create and spyreccl_torch.backend_name() == "spyreccl"
dist.Backend.register_backend("spyreccl", foreign, devices=["spyre"])
assert creator("spyreccl") is foreign, "torch's last-writer-wins was undone"
assert spyreccl_torch.vendor_plugin().creator_fn is foreign
assert spyreccl_torch.backend_name() == "spyreccl_shm"
assert spyreccl_torch.is_registered() and creator("spyreccl_shm") is _registration._create
assert dist.get_default_backend_for_device("spyre") == "spyreccl"  # now the vendor's
all_reduce_through("spyreccl_shm")
print("ok")
"""
    )
    assert out.stdout.strip().endswith("ok")
    assert out.stderr == "", out.stderr


def test_an_earlier_foreign_spyreccl_is_kept() -> None:
    # The foreign backend registers before our package is imported (autoload disabled).
    out = _run(
        _FOREIGN.replace("import spyreccl_torch\nfrom spyreccl_torch import _registration\n", "")
        + """
dist.Backend.register_backend("spyreccl", foreign)  # no devices: it claims no default
assert "spyre" not in dist.Backend.default_device_backend_map
import spyreccl_torch
from spyreccl_torch import _registration
assert creator("spyreccl") is foreign
assert spyreccl_torch.vendor_plugin().creator_fn is foreign
assert creator("spyreccl_shm") is _registration._create
assert spyreccl_torch.backend_name() == "spyreccl_shm"
# Our second name does not become spyre's default beside a vendor's backend either.
assert "spyre" not in dist.Backend.default_device_backend_map
all_reduce_through("cpu:gloo,spyre:spyreccl_shm")
print("ok")
""",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("later", [False, True], ids=["foreign-first", "foreign-later"])
def test_override_makes_ours_the_one_behind_spyreccl(later: bool) -> None:
    if later:
        setup = "import spyreccl_torch\n" + 'dist.Backend.register_backend("spyreccl", foreign)\n'
    else:
        setup = 'dist.Backend.register_backend("spyreccl", foreign)\n' + "import spyreccl_torch\n"
    out = _run(
        _FOREIGN.replace("import spyreccl_torch\nfrom spyreccl_torch import _registration\n", "")
        + setup
        + """
from spyreccl_torch import _registration
assert creator("spyreccl") is _registration._create
assert spyreccl_torch.vendor_plugin().creator_fn is foreign  # remembered for routing
assert spyreccl_torch.backend_name() == "spyreccl"
assert dist.get_default_backend_for_device("spyre") == "spyreccl"
all_reduce_through(None)
print("ok")
""",
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        SPYRECCL_OVERRIDE_VENDOR="1",
    )
    assert out.stdout.strip().endswith("ok")


def test_a_later_foreign_backend_for_spyre_takes_the_default() -> None:
    _run(
        _FOREIGN
        + """
assert dist.get_default_backend_for_device("spyre") == "spyreccl"
dist.Backend.register_backend("vendorccl", foreign, devices=["spyre"])
# torch keeps the first registration as a device's default; ours steps aside for theirs.
assert dist.get_default_backend_for_device("spyre") == "vendorccl"
assert creator("spyreccl") is _registration._create  # the name is not theirs
assert spyreccl_torch.vendor_plugin() is None
"""
    )


def test_routing_without_a_vendor_is_our_plain_backend() -> None:
    _run(
        _FOREIGN + 'all_reduce_through("spyreccl")\n',
        SPYRECCL_ROUTE_TO_VENDOR="1",
    )

"""pytest plugin (entry point `pytest11`): rank-pool fixtures, markers and the report header.

Importing this module must not import torch: the plugin is active in every pytest run of an
environment where spyreccl-testing is installed, torch-free spyreccl-core test runs included.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from spyreccl_testing import _procutil
from spyreccl_testing.pool import RankPool
from spyreccl_testing.seeds import fresh_seed

_DEFAULT_WORLD_SIZES = "2 3"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "spyreccl_world_sizes",
        "world sizes of the rank_pool fixture when a test has no world_sizes marker",
        default=_DEFAULT_WORLD_SIZES,
    )
    parser.addini(
        "spyreccl_check_shm",
        "fail a pool fixture's teardown when spyreccl-* segments were left in /dev/shm",
        type="bool",
        default=True,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world_sizes(*sizes): world sizes the rank_pool fixture is parametrized with "
        "(default from the spyreccl_world_sizes ini option: 2 3)",
    )
    config.addinivalue_line(
        "markers",
        "rank_pool_options(**kwargs): RankPool keyword arguments (backend=, set_device=, env=, "
        "distributed=, device_id=, task_wrapper=, ...) for the module's rank_pool, plus "
        "shared=True to reuse one pool per world size and options across the session; read "
        "from the module level only, on top of the rank_pool_defaults fixture",
    )


# -- report header ---------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _spyre_device_line() -> str:
    torch_version = _version("torch")
    if torch_version == "not installed":
        return "spyre device: none (torch not installed)"
    if _version("torch_spyre") != "not installed" or _version("torch-spyre") != "not installed":
        kind = "real (torch_spyre)"
    elif _version("spyreccl-torch") != "not installed":
        kind = "emulated (spyreccl-torch)"
    else:
        return "spyre device: none (neither torch_spyre nor spyreccl-torch is installed)"
    try:
        import torch

        spyre = getattr(torch, "spyre", None)
        count = spyre.device_count() if spyre is not None else "unavailable: torch.spyre missing"
    except Exception as exc:  # the header must never break collection
        count = f"unavailable: {type(exc).__name__}: {exc}"
    return f"spyre device: {kind}, count={count}"


def pytest_report_header(config: pytest.Config) -> list[str]:
    versions = ", ".join(
        f"{name} {_version(name)}" for name in ("torch", "spyreccl-core", "spyreccl-torch")
    )
    return [f"spyreccl: {versions}", _spyre_device_line()]


# -- parametrization -------------------------------------------------------------------------


def _default_world_sizes(config: pytest.Config) -> list[int]:
    raw = config.getini("spyreccl_world_sizes")
    text = raw if isinstance(raw, str) else " ".join(raw)
    try:
        sizes = [int(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise pytest.UsageError(
            f"spyreccl_world_sizes = {text!r}: expected whitespace-separated integers"
        ) from None
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"spyreccl_world_sizes = {text!r}: expected integers >= 1")
    return sizes


def _explicitly_parametrized(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        argnames = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(argnames, str):
            argnames = [a.strip() for a in argnames.split(",")]
        if name in argnames:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "rank_pool" not in metafunc.fixturenames:
        return
    if _explicitly_parametrized(metafunc, "rank_pool"):
        return  # @pytest.mark.parametrize("rank_pool", [...], indirect=True) wins
    marker = metafunc.definition.get_closest_marker("world_sizes")
    if marker is not None:
        sizes = list(marker.args)
        if not sizes or not all(isinstance(s, int) and s >= 1 for s in sizes):
            raise pytest.UsageError(
                f"{metafunc.definition.nodeid}: world_sizes marker needs integers >= 1, "
                f"got {marker.args!r}"
            )
    else:
        sizes = _default_world_sizes(metafunc.config)
    # Module scope: all tests of a module that share a world size share one pool.
    metafunc.parametrize(
        "rank_pool", sizes, indirect=True, scope="module", ids=[f"ws{s}" for s in sizes]
    )


# -- fixtures --------------------------------------------------------------------------------


def _pool_options(node: pytest.Item | pytest.Collector, defaults: dict[str, Any]) -> dict[str, Any]:
    options = dict(defaults)
    marker = node.get_closest_marker("rank_pool_options")
    if marker is not None:
        if marker.args:
            raise pytest.UsageError("rank_pool_options takes keyword arguments only")
        options.update(marker.kwargs)
    return options


def _close_and_check(pools: list[RankPool], baseline: set[str], check_shm: bool) -> None:
    for pool in pools:
        pool.close()
    if check_shm:
        leaked = _procutil.new_shm_leftovers(baseline)
        if leaked:
            pytest.fail(
                "spyreccl shared-memory segments were left in /dev/shm after the rank pool shut "
                f"down: {sorted(leaked)} (a communicator was not destroyed, or a segment is "
                "not unlinked once every rank attached)",
                pytrace=False,
            )


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a pool option, equal for equal settings (functions by name)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple | set | frozenset):
        return tuple(_freeze(v) for v in value)
    if callable(value):
        return ("callable", getattr(value, "__module__", ""), getattr(value, "__qualname__", ""))
    return value


class SharedPools:
    """The session's shared pools, one per (world size, options): modules whose rank_pool
    options say shared=True reuse a pool (and its workers' imports, e.g. torch's ~3 s per rank)
    instead of starting their own. Closed, and /dev/shm checked, at the end of the session."""

    def __init__(self) -> None:
        self.pools: dict[Any, RankPool] = {}
        self.baseline = _procutil.list_spyreccl_shm()

    def get(self, world_size: int, options: dict[str, Any]) -> RankPool:
        key = (world_size, _freeze(options))
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = RankPool(world_size, **options)
        return pool


@pytest.fixture(scope="session")
def rank_pool_defaults() -> dict[str, Any]:
    """Default RankPool options of every rank_pool in scope; the module's rank_pool_options
    marker overrides them key by key. Override this fixture in a conftest.py to configure a
    whole test directory (e.g. distributed=False and a task_wrapper for torch-free tests)."""
    return {}


@pytest.fixture(scope="session")
def shared_rank_pools(request: pytest.FixtureRequest) -> Iterator[SharedPools]:
    """The registry behind rank_pool_options(shared=True)."""
    shared = SharedPools()
    try:
        yield shared
    finally:
        _close_and_check(
            list(shared.pools.values()),
            shared.baseline,
            request.config.getini("spyreccl_check_shm"),
        )


@pytest.fixture(scope="module")
def rank_pool(
    request: pytest.FixtureRequest, rank_pool_defaults: dict[str, Any]
) -> Iterator[RankPool]:
    """A RankPool shared by the tests of one module, parametrized over world sizes (marker
    `world_sizes`, default 2 and 3). Pool options: the rank_pool_defaults fixture, overridden by
    a module-level `pytestmark = pytest.mark.rank_pool_options(...)`. With shared=True the pool
    is the session's pool for that world size and options, started once for all such modules
    (safe when the modules leave the process group as they found it)."""
    world_size = getattr(request, "param", None)
    if world_size is None:
        sizes = _default_world_sizes(request.config)
        world_size = sizes[0]
    if not isinstance(world_size, int) or world_size < 1:
        raise pytest.UsageError(
            f"rank_pool: world size must be an integer >= 1, got {world_size!r}"
        )
    options = _pool_options(request.node, rank_pool_defaults)
    if options.pop("shared", False):
        shared: SharedPools = request.getfixturevalue("shared_rank_pools")
        yield shared.get(world_size, options)
        return
    baseline = _procutil.list_spyreccl_shm()
    pool = RankPool(world_size, **options)
    try:
        yield pool
    finally:
        _close_and_check([pool], baseline, request.config.getini("spyreccl_check_shm"))


@pytest.fixture
def make_pool(request: pytest.FixtureRequest) -> Iterator[Callable[..., RankPool]]:
    """Factory for pools with custom settings: make_pool(world_size, backend=..., env=...).
    Every pool it made is closed (and /dev/shm checked) when the test ends."""
    baseline = _procutil.list_spyreccl_shm()
    pools: list[RankPool] = []

    def factory(world_size: int, **options: Any) -> RankPool:
        pool = RankPool(world_size, **options)
        pools.append(pool)
        return pool

    try:
        yield factory
    finally:
        _close_and_check(pools, baseline, request.config.getini("spyreccl_check_shm"))


# -- seeds -----------------------------------------------------------------------------------


class Seeded:
    """A fresh seed for one test (os.urandom, or SPYRECCL_TEST_SEED to replay a failure) and
    numpy generators derived from it. The seed is shown with the test's failure report."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def rng(self, *stream: int) -> np.random.Generator:
        """A generator for one independent stream of this test's randomness (e.g. per rank)."""
        return np.random.default_rng([self.seed, *stream])


_SEED_ATTR = "_spyreccl_seed"


@pytest.fixture
def seeded(request: pytest.FixtureRequest) -> Seeded:
    """A fresh Seeded for this test; on failure the report gets a "spyreccl random seed"
    section with the value to put into SPYRECCL_TEST_SEED."""
    value = Seeded(fresh_seed())
    setattr(request.node, _SEED_ATTR, value.seed)
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    seed = getattr(item, _SEED_ATTR, None)
    if report.failed and seed is not None:
        report.sections.append(("spyreccl random seed", f"SPYRECCL_TEST_SEED={seed}"))
    return report

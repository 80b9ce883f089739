"""pytest plugin (entry point `pytest11`): rank-pool fixtures, markers and the report header.

Importing this module must not import torch: the plugin is active in every pytest run of an
environment where spyreccl-testing is installed, torch-free spyreccl-core test runs included.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spyreccl_testing import _procutil
from spyreccl_testing.pool import RankPool

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
        "distributed=, ...) for the module's rank_pool; read from the module level only",
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


def _pool_options(node: pytest.Item | pytest.Collector) -> dict[str, Any]:
    marker = node.get_closest_marker("rank_pool_options")
    if marker is None:
        return {}
    if marker.args:
        raise pytest.UsageError("rank_pool_options takes keyword arguments only")
    return dict(marker.kwargs)


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


@pytest.fixture(scope="module")
def rank_pool(request: pytest.FixtureRequest) -> Iterator[RankPool]:
    """A RankPool shared by the tests of one module, parametrized over world sizes (marker
    `world_sizes`, default 2 and 3). Pool options come from a module-level
    `pytestmark = pytest.mark.rank_pool_options(...)`."""
    world_size = getattr(request, "param", None)
    if world_size is None:
        sizes = _default_world_sizes(request.config)
        world_size = sizes[0]
    if not isinstance(world_size, int) or world_size < 1:
        raise pytest.UsageError(
            f"rank_pool: world size must be an integer >= 1, got {world_size!r}"
        )
    baseline = _procutil.list_spyreccl_shm()
    pool = RankPool(world_size, **_pool_options(request.node))
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

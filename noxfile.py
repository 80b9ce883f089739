"""Every development and CI task of the spyreccl monorepo.

    nox -l                      list the sessions
    nox -s lint tests pins docs tests_discrete   what CI runs (ci/test.sh)
    nox -s demo                 the main job: tensor-parallel serving + training (ci/demo.sh)
    nox -s core_tests           spyreccl-core alone, without torch
    nox -s tests_discrete       device + staged path with spyre memory the host cannot read
    nox -s sanitize             core C++ tests under ASan+UBSan and TSan
    nox -s bench -- --help      benchmarks (arguments after `--` go to spyreccl-bench)
    nox -s docs                 checks the commands quoted in README.md and docs/

Torch versions: spyreccl-torch supports every torch minor in TORCH_MINORS (its pyproject
declares the same range; the `pins` session checks both). `tests` runs the full suite on
TORCH_PINNED, the minor whose CPU wheel lies on this project's machines; `smoke(torch=...)`
builds against any minor and runs SMOKE_TESTS, a subset that exercises every layer
(arguments after `--` replace the subset, e.g. a whole test directory). Every minor but the
local one is a multi-GB CUDA build from PyPI; ci/test.sh keeps those venvs outside the
checkout (nox --envdir) so that later runs reuse them. See docs/development.md.

Native builds: spyreccl-core and spyreccl-torch are installed with --no-build-isolation (the
torch extension must compile against the torch in the venv; isolation would download another
one) into build trees under packages/<pkg>/build/nox-<session>/, kept between runs so rebuilds
are incremental. ccache is used when it is on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import nox
import nox.command

nox.options.default_venv_backend = "venv"
# Reusing a venv is safe here: the requirements are pinned or ranges that pip re-checks, and
# the project's own packages (local directories) are rebuilt and reinstalled on every run.
nox.options.reuse_venv = "yes"
nox.options.error_on_external_run = True
nox.options.stop_on_first_error = False

ROOT = Path(__file__).resolve().parent
CORE = ROOT / "packages" / "spyreccl-core"
TORCH_PKG = ROOT / "packages" / "spyreccl-torch"
TESTING = ROOT / "packages" / "spyreccl-testing"

# The torch minors spyreccl-torch supports: [project].dependencies says torch>=first,<next
# after the last (checked by `pins`). 2.10 is the one torch-spyre pins.
TORCH_MINORS = ["2.10", "2.11", "2.12", "2.13", "2.14", "2.15"]
# The minor of the full suite, the demo and the bench: its CPU wheel is on the machines' disk.
TORCH_PINNED = "2.13"
# One test (or file) per layer for the other minors: ops on 2 and 3 ranks, registration and
# autoload, the emulated device, functional collectives eager and compiled (inductor), DDP,
# FSDP2, a multi-node job and the bench. Paths relative to packages/spyreccl-torch/tests.
SMOKE_TESTS = [
    "ops/test_all_reduce.py",
    "ops/test_all_gather_into_tensor.py",
    "ops/test_broadcast.py",
    "ops/test_all_to_all_single.py",
    "test_registration.py",
    "test_backend_smoke.py",
    "test_device.py",
    "test_funcol_fast_path.py::test_every_functional_op_matches_float64",
    "test_funcol_fast_path.py::test_lean_path_is_taken_and_agrees_with_torchs_path",
    "test_funcol_fast_path.py::test_autograd_of_the_cpp_kernels",
    "test_compile_collectives.py::test_compiled_collectives_match_eager",
    "test_compile_collectives.py::test_inductor_really_ran",
    "test_ddp.py::test_ddp_matches_single_process",
    "test_fsdp2.py::test_fsdp2_loss_curve_matches_reference",
    "multinode/test_multinode.py::test_two_nodes_two_ranks_every_operation",
    "bench/test_bench_end_to_end.py::test_sweep_all_levels_odd_world_size",
]
# What one smoke run needs at most: a fresh CUDA torch venv (~7 GB on disk) and, with a cold
# compiler cache, the build (see docs/development.md for measured times).
SMOKE_VENV_GB = 9

# Exact tool versions: a new formatter release must not turn CI red on unchanged code.
RUFF = "ruff==0.17.6"
CLANG_FORMAT = "clang-format==23.1.5"
TEST_REQUIREMENTS = ["numpy", "pytest>=8", "hypothesis", "matplotlib", "tqdm"]
BUILD_REQUIREMENTS = [
    "scikit-build-core>=0.10",
    "pybind11>=2.12",
    "ninja",
    "cmake>=3.18",
    "hatchling",
]

# Strictness that a package's own pytest configuration cannot relax. pytest's exit code 5
# ("no tests collected") is non-zero, so nox fails the session on it like on any failure.
PYTEST_STRICT = ["--strict-markers", "-o", "xfail_strict=true", "-p", "no:cacheprovider", "-ra"]

CPP_SUFFIXES = {".h", ".hpp", ".hh", ".c", ".cc", ".cpp", ".cxx"}
DEMO_SCRIPTS = ["examples/tp_llama.py", "packages/spyreccl-torch/examples/tp_llama.py"]


# -- helpers ---------------------------------------------------------------------------------


def _build_dir_name(session: nox.Session) -> str:
    return "build/nox-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", session.name).strip("-")


def _native_build_env(session: nox.Session) -> None:
    # The machine (and CI) has 2 cores and shares its memory: never more than 2 jobs.
    session.env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    if shutil.which("ccache") and "CMAKE_CXX_COMPILER_LAUNCHER" not in os.environ:
        session.env["CMAKE_CXX_COMPILER_LAUNCHER"] = "ccache"
        session.env["CMAKE_C_COMPILER_LAUNCHER"] = "ccache"
        # Paths under the checkout are hashed relative to it, so a fresh clone elsewhere
        # (CI) hits the cache that earlier builds filled.
        session.env.setdefault("CCACHE_BASEDIR", str(ROOT))


def _install_native(session: nox.Session, package: Path) -> None:
    if not (package / "pyproject.toml").exists():
        session.error(f"{package.relative_to(ROOT)}/pyproject.toml is missing: cannot build it")
    session.install(
        "--no-build-isolation",
        "-C",
        f"build-dir={_build_dir_name(session)}/{{wheel_tag}}",
        str(package),
    )


def _install_stack(session: nox.Session, torch_minor: str | None) -> None:
    """Installs test tools, build tools, the core, the torch package (when torch_minor is
    given) and the testing plugin into the session's venv."""
    if torch_minor is not None:
        # First and alone, so that nothing else can drag in a different (CUDA) torch build.
        session.install(f"torch=={torch_minor}.*")
    session.install(*TEST_REQUIREMENTS, *BUILD_REQUIREMENTS)
    _native_build_env(session)
    _install_native(session, CORE)
    if torch_minor is not None:
        _install_native(session, TORCH_PKG)
    session.install("--no-build-isolation", str(TESTING))


def _pytest(session: nox.Session, test_dir: Path, *extra: str) -> None:
    if not test_dir.is_dir():
        session.warn(f"test directory {test_dir.relative_to(ROOT)} does not exist")
        raise nox.command.CommandFailed(f"missing {test_dir.relative_to(ROOT)}")
    session.run(
        "python",
        "-m",
        "pytest",
        *PYTEST_STRICT,
        "--durations=10",
        *extra,
        str(test_dir),
        *session.posargs,
    )


def _run_all(session: nox.Session, steps: dict[str, Callable[[], None]]) -> None:
    """Runs every step even when an earlier one fails (so one CI run reports every failing
    suite), then fails the session naming the failed steps."""
    failed = []
    for name, step in steps.items():
        try:
            step()
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error(f"failed: {', '.join(failed)}")


def _ctest(
    session: nox.Session, build_dir: Path, *cmake_args: str, env: dict | None = None
) -> None:
    """Configures, builds and runs the core's C++ tests in build_dir."""
    if not (CORE / "tests" / "cpp").is_dir():
        session.warn(
            "SKIPPED C++ tests: packages/spyreccl-core/tests/cpp does not exist yet "
            "(nothing for ctest to run)"
        )
        return
    python = session.run("python", "-c", "import sys; print(sys.executable)", silent=True)
    if python is None:  # `nox --install-only`: session.run runs nothing
        return
    pybind11_dir = session.run("python", "-m", "pybind11", "--cmakedir", silent=True)
    session.run(
        "cmake",
        "-S",
        str(CORE),
        "-B",
        str(build_dir),
        "-G",
        "Ninja",
        "-DSPYRECCL_BUILD_TESTS=ON",
        # the smoke test and the timing driver too: ctest runs both end to end
        "-DSPYRECCL_BUILD_TOOLS=ON",
        f"-DPython_EXECUTABLE={python.strip()}",
        f"-Dpybind11_DIR={pybind11_dir.strip()}",
        *cmake_args,
    )
    session.run("cmake", "--build", str(build_dir), "-j2")
    session.run(
        "ctest",
        "--test-dir",
        str(build_dir),
        "--output-on-failure",
        "--no-tests=error",
        "--timeout",
        "600",
        env=env or {},
    )


# -- sessions --------------------------------------------------------------------------------


@nox.session
@nox.parametrize("torch", [TORCH_PINNED])
def tests(session: nox.Session, torch: str) -> None:
    """Full suite against torch==<torch>.*: testing plugin, core (Python + C++), torch package."""
    _install_stack(session, torch)
    _run_all(
        session,
        {
            "spyreccl-testing tests": lambda: _pytest(session, TESTING / "tests"),
            "spyreccl-core Python tests": lambda: _pytest(session, CORE / "tests" / "python"),
            "spyreccl-torch tests": lambda: _pytest(session, TORCH_PKG / "tests"),
            "spyreccl-core C++ tests": lambda: _ctest(session, CORE / "build" / "ctest"),
        },
    )


def _torch_sources_digest() -> str:
    """A digest of what a spyreccl-torch build compiles (sources, CMake files)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(
        p
        for top in (TORCH_PKG / "src", TORCH_PKG / "cmake", TORCH_PKG / "CMakeLists.txt")
        for p in ([top] if top.is_file() else top.rglob("*"))
        if p.is_file()
    ):
        digest.update(str(path.relative_to(TORCH_PKG)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _built_stamp(session: nox.Session) -> Path:
    # In the venv, which outlives checkouts: the sources its last successful build compiled.
    return Path(session.virtualenv.location) / ".spyreccl-built-sources"


def _smoke_affordable(session: nox.Session, torch: str) -> None:
    """Skips (with the reason) a smoke run that the disk or CI's time budget cannot take.

    SPYRECCL_CI_DEADLINE (seconds since the epoch, set by ci/test.sh) is when CI must be done.
    A run needs SPYRECCL_SMOKE_MINUTES (default 15) when this venv last built the same
    sources (the compiler cache holds them), SPYRECCL_SMOKE_COLD_MINUTES (default 35, a
    cold build on 2 shared cores) otherwise."""
    venv = Path(session.virtualenv.location)
    if not any(venv.glob("lib/python*/site-packages/torch/version.py")):
        free_gb = shutil.disk_usage(venv).free / 2**30
        if free_gb < SMOKE_VENV_GB + 5:
            session.skip(
                f"SKIPPED smoke(torch={torch}): a new torch {torch} venv needs ~{SMOKE_VENV_GB} GB "
                f"and {free_gb:.0f} GB are free (keeping 5 GB for the others)"
            )
    deadline = os.environ.get("SPYRECCL_CI_DEADLINE")
    if deadline:
        import time

        stamp = _built_stamp(session)
        warm = stamp.is_file() and stamp.read_text() == _torch_sources_digest()
        need_min = float(
            os.environ.get("SPYRECCL_SMOKE_MINUTES", "15")
            if warm
            else os.environ.get("SPYRECCL_SMOKE_COLD_MINUTES", "35")
        )
        left_min = (float(deadline) - time.time()) / 60
        if left_min < need_min:
            session.skip(
                f"SKIPPED smoke(torch={torch}): {left_min:.0f} min left of CI's budget, a smoke "
                f"run with a {'warm' if warm else 'cold'} build may take {need_min:.0f} min"
            )


@nox.session(default=False)
@nox.parametrize("torch", TORCH_MINORS)
def smoke(session: nox.Session, torch: str) -> None:
    """Build against torch==<torch>.* and run SMOKE_TESTS (or the pytest arguments given
    after `--`). Every minor but TORCH_PINNED is a CUDA build of torch from PyPI."""
    _smoke_affordable(session, torch)
    # This machine's pip configuration may cap torch releases (a constraints file); the
    # matrix installs every supported minor from PyPI, so this session reads no machine
    # constraint. `torch==2.13.*` still takes the local CPU wheel: 2.13.0+cpu sorts above
    # PyPI's 2.13.0. No pip cache: each CUDA minor is ~4 GB of wheels, kept once, in its venv.
    session.env["PIP_CONSTRAINT"] = os.devnull
    session.env["PIP_NO_CACHE_DIR"] = "1"
    _install_stack(session, torch)
    # What the compiler cache now holds for this torch (a heuristic for the budget check).
    _built_stamp(session).write_text(_torch_sources_digest())
    session.run(
        "python",
        "-c",
        "import sys, torch; v = torch.__version__; print('torch', v); "
        f"sys.exit(0 if v.startswith('{torch}.') else 'expected torch {torch}.*, got ' + v)",
    )
    tests = session.posargs or [str(TORCH_PKG / "tests" / test) for test in SMOKE_TESTS]
    session.run("python", "-m", "pytest", *PYTEST_STRICT, "--durations=10", *tests)


@nox.session
def core_tests(session: nox.Session) -> None:
    """spyreccl-core alone (C++ and Python tests); torch is never installed here."""
    _install_stack(session, None)
    session.run(
        "python",
        "-c",
        "import importlib.util, sys; "
        "sys.exit('core_tests: torch is installed' if importlib.util.find_spec('torch') else 0)",
    )
    _run_all(
        session,
        {
            "spyreccl-core Python tests": lambda: _pytest(session, CORE / "tests" / "python"),
            "spyreccl-core C++ tests": lambda: _ctest(session, CORE / "build" / "ctest"),
        },
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (check + format) on all Python; clang-format on the C/C++ sources and tests."""
    session.install(RUFF, CLANG_FORMAT)
    sources = sorted(
        str(path)
        for pattern in ("packages/*/src", "packages/*/include", "packages/*/tests/cpp")
        for top in ROOT.glob(pattern)
        for path in top.rglob("*")
        if path.suffix in CPP_SUFFIXES and "build" not in path.relative_to(ROOT).parts
    )
    if not sources:
        session.error("lint: found no C/C++ sources under packages/*/{src,include,tests/cpp}")
    _run_all(
        session,
        {
            "ruff check": lambda: session.run("ruff", "check", str(ROOT)),
            "import circles": lambda: session.run(
                "python", str(ROOT / "ci" / "check_imports.py"), str(ROOT)
            ),
            "ruff format": lambda: session.run("ruff", "format", "--check", "--diff", str(ROOT)),
            "clang-format": lambda: session.run("clang-format", "--dry-run", "-Werror", *sources),
        },
    )


@nox.session(default=False)
def sanitize(session: nox.Session) -> None:
    """Core C++ tests built with -DSPYRECCL_SANITIZE=address and =thread, run with ctest."""
    session.install("cmake>=3.18", "ninja", "pybind11>=2.12")
    _native_build_env(session)
    sanitizers = {
        "AddressSanitizer": (
            "address",
            {
                "ASAN_OPTIONS": "abort_on_error=1:detect_leaks=1:strict_string_checks=1",
                "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
            },
        ),
        "ThreadSanitizer": ("thread", {"TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1"}),
    }

    def build_and_run(kind: str, env: dict[str, str]) -> Callable[[], None]:
        build_dir = CORE / "build" / {"address": "asan", "thread": "tsan"}[kind]
        return lambda: _ctest(
            session,
            build_dir,
            f"-DSPYRECCL_SANITIZE={kind}",
            "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
            env=env,
        )

    _run_all(session, {name: build_and_run(*spec) for name, spec in sanitizers.items()})


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks: installs the stack and runs `spyreccl-bench <posargs>`."""
    _install_stack(session, TORCH_PINNED)
    script = Path(session.bin) / "spyreccl-bench"
    if script.exists():
        session.run("spyreccl-bench", *session.posargs)
    else:
        # Until spyreccl-torch declares the console script, its module entry point is the same
        # command line interface.
        session.warn(
            "spyreccl-bench console script not installed; using python -m spyreccl_torch.bench"
        )
        session.run("python", "-m", "spyreccl_torch.bench", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: tensor-parallel serving and training on 2 ranks with torchrun over spyreccl."""
    scripts = [ROOT / s for s in DEMO_SCRIPTS if (ROOT / s).is_file()]
    if not scripts:
        session.error(
            "the demo script does not exist yet: expected one of "
            + ", ".join(DEMO_SCRIPTS)
            + " (written by the spyreccl-torch engineer)"
        )
    _install_stack(session, TORCH_PINNED)
    session.env.setdefault("OMP_NUM_THREADS", "1")
    session.run(
        "torchrun", "--standalone", "--nproc-per-node", "2", str(scripts[0]), *session.posargs
    )


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Checks that runnable commands quoted in README.md and docs/ name existing sessions and
    files, and that the docs name no tracker issues, work sessions or machines by how they were
    obtained (see ci/check_docs.py). CI runs it through ci/test.sh."""
    import nox.registry

    names = sorted({name.split("(")[0] for name in nox.registry.get()})
    session.run("python", str(ROOT / "ci" / "check_docs.py"), "--sessions", *names)


@nox.session
def pins(session: nox.Session) -> None:
    """spyreccl-torch's torch range is exactly the matrix's minors (TORCH_MINORS); its
    spyreccl-core pin matches the core's version (pyproject and C header)."""
    session.run("python", str(ROOT / "ci" / "check_pins.py"), "--torch-minors", *TORCH_MINORS)


# What runs with SPYRECCL_SPYRE_MEMORY=discrete in `tests_discrete`: a spyre tensor's
# data_ptr() then faults when the host reads it (as on real Spyre cards), so the device's own
# tests show that every torch operation still works, and the backend must stage every spyre
# tensor through host buffers (the collective, functional/compiled, DDP, FSDP2, TP training
# and decode, vendor routing, reliability and multi-node tests check its numbers against the
# same references).
DISCRETE_MEMORY_TESTS = [
    "tests/test_device.py",
    "tests/test_device_autocast.py",
    "tests/test_device_inductor.py",
    "tests/test_device_memory_mode.py",
    "tests/test_random.py",
    "tests/test_attention.py",
    "tests/test_device_rnn.py",
    "tests/test_memory.py",
    "tests/test_host_view.py",
    "tests/test_sync_batch_norm.py",
    "tests/ops",
    "tests/test_staged_path.py",
    "tests/test_staged_send_recv.py",
    "tests/test_functional_collectives.py",
    "tests/test_funcol_fast_path.py",
    "tests/test_compile_collectives.py",
    "tests/test_ddp.py",
    "tests/test_fsdp2.py",
    "tests/test_dtensor_tp.py",
    "tests/test_2d_mesh.py",
    "tests/test_tp_generate.py",
    "tests/test_llama_consumers.py",
    "tests/test_direct_ops.py",
    "tests/test_inline_fastpath.py",
    "tests/test_future_callbacks.py",
    "tests/test_vendor_coexistence.py",
    "tests/reliability/test_timeouts_and_abort.py",
    "tests/reliability/test_peer_death.py",
    "tests/reliability/test_mismatch.py",
    "tests/reliability/test_flight_recorder.py",
    "tests/multinode/test_multinode.py::test_two_nodes_two_ranks_every_operation",
]


@nox.session(default=False)
def tests_discrete(session: nox.Session) -> None:
    """The device's tests and the backend's staged path with SPYRECCL_SPYRE_MEMORY=discrete
    (rank pools and launched jobs inherit the environment: every rank runs discrete).
    Arguments after `--` that name tests (existing paths relative to packages/spyreccl-torch,
    e.g. `tests/test_staged_path.py` or `tests/ops/test_gather.py::test_x`) replace
    DISCRETE_MEMORY_TESTS; the others (pytest options and their values) are passed on."""
    _install_stack(session, TORCH_PINNED)

    def names_tests(arg: str) -> bool:
        return not arg.startswith("-") and (TORCH_PKG / arg.split("::")[0]).exists()

    named = [arg for arg in session.posargs if names_tests(arg)]
    options = [arg for arg in session.posargs if not names_tests(arg)]
    session.run(
        "python",
        "-m",
        "pytest",
        *PYTEST_STRICT,
        "--durations=10",
        *(str(TORCH_PKG / path) for path in (named or DISCRETE_MEMORY_TESTS)),
        *options,
        env={"SPYRECCL_SPYRE_MEMORY": "discrete"},
    )

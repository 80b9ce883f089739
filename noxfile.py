"""Every development and CI task of the spyreccl monorepo.

    nox -l                      list the sessions
    nox -s lint tests pins docs tests_discrete   what CI runs (ci/test.sh)
    nox -s demo                 the main job: tensor-parallel serving + training (ci/demo.sh)
    nox -s core_tests           spyreccl-core alone, without torch
    nox -s tests_discrete       device + staged path with spyre memory the host cannot read
    nox -s sanitize             core C++ tests under ASan+UBSan and TSan
    nox -s bench -- --help      benchmarks (arguments after `--` go to spyreccl-bench)
    nox -s docs                 checks the commands quoted in README.md and docs/

Torch versions: the `tests` session is parametrized by torch minor (TORCH_MINORS). Each minor
is installed as `torch==<minor>.*` into its own virtualenv; on this project's machines pip
finds the CPU wheel of 2.13 locally, while any other minor is a multi-GB CUDA download from
PyPI. To test another minor, add it to TORCH_MINORS (and widen spyreccl-torch's `torch==`
pin, which the `pins` session checks against TORCH_PINNED).

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

TORCH_MINORS = ["2.13"]
TORCH_PINNED = "2.13"  # the minor spyreccl-torch pins (`torch==2.13.*`); checked by `pins`

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
@nox.parametrize("torch", TORCH_MINORS)
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
    """spyreccl-torch's torch pin matches the torch the tests install; its spyreccl-core pin
    matches the core's version (pyproject and C header)."""
    session.run("python", str(ROOT / "ci" / "check_pins.py"), "--torch", TORCH_PINNED)


# What runs with SPYRECCL_SPYRE_MEMORY=discrete in `tests_discrete`: a spyre tensor's
# data_ptr() then faults when the host reads it (as on real Spyre cards), so the device's own
# tests show that every torch operation still works, and the backend must stage every spyre
# tensor through host buffers (the collective, functional/compiled, DDP, FSDP2, TP,
# reliability and multi-node tests check its numbers against the same references).
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
    "tests/test_functional_collectives.py",
    "tests/test_funcol_fast_path.py",
    "tests/test_compile_collectives.py",
    "tests/test_ddp.py",
    "tests/test_fsdp2.py",
    "tests/test_dtensor_tp.py",
    "tests/reliability/test_timeouts_and_abort.py",
    "tests/reliability/test_peer_death.py",
    "tests/reliability/test_mismatch.py",
    "tests/multinode/test_multinode.py::test_two_nodes_two_ranks_every_operation",
]


@nox.session(default=False)
def tests_discrete(session: nox.Session) -> None:
    """The device's tests and the backend's staged path with SPYRECCL_SPYRE_MEMORY=discrete
    (rank pools and launched jobs inherit the environment: every rank runs discrete)."""
    _install_stack(session, TORCH_PINNED)
    session.run(
        "python",
        "-m",
        "pytest",
        *PYTEST_STRICT,
        "--durations=10",
        *(str(TORCH_PKG / path) for path in DISCRETE_MEMORY_TESTS),
        *session.posargs,
        env={"SPYRECCL_SPYRE_MEMORY": "discrete"},
    )

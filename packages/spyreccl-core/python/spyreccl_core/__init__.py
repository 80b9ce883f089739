"""spyreccl_core: host shared-memory collectives (libspyreccl) for Python, without torch.

The compiled module ``_core`` binds the C API; this package re-exports it and adds
torch-free helpers to form a communicator (``init_from_file``, ``init_from_env``,
``launch``) plus the paths that other builds need to find the C library
(``cmake_dir()``, ``include_dir()``, ``library_path()``).

    comm = spyreccl_core.init_from_file("/tmp/job42.id", rank, size)
    comm.all_reduce(array)          # in place, SUM
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from ._core import (
    UNIQUE_ID_BYTES,
    AbortedError,
    Communicator,
    DataType,
    Group,
    InternalError,
    InvalidArgumentError,
    InvalidUsageError,
    MismatchError,
    ReduceOp,
    RemoteError,
    Request,
    Result,
    SharedBuffer,
    SpyrecclError,
    SystemError_,
    TimeoutError,
    UniqueId,
    UnsupportedError,
    error_string,
    group,
    group_end,
    group_start,
    library_version,
    set_thread_yield,
)
from .launch import LaunchError, launch
from .memory import empty
from .rendezvous import init_from_env, init_from_file, init_from_tcp

try:
    __version__: str = importlib.metadata.version("spyreccl-core")
except importlib.metadata.PackageNotFoundError:  # imported from a build tree
    from ._core import __version__

__all__ = [
    "UNIQUE_ID_BYTES",
    "AbortedError",
    "Communicator",
    "DataType",
    "Group",
    "InternalError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "LaunchError",
    "MismatchError",
    "ReduceOp",
    "RemoteError",
    "Request",
    "Result",
    "SharedBuffer",
    "SpyrecclError",
    "SystemError_",
    "TimeoutError",
    "UniqueId",
    "UnsupportedError",
    "__version__",
    "cmake_dir",
    "empty",
    "error_string",
    "group",
    "group_end",
    "group_start",
    "include_dir",
    "init_from_env",
    "init_from_file",
    "init_from_tcp",
    "launch",
    "library_path",
    "library_version",
    "set_thread_yield",
]

_PACKAGE_DIR = Path(__file__).resolve().parent


def _installed(path: Path, what: str) -> str:
    if not path.exists():
        raise FileNotFoundError(
            f"spyreccl_core: {what} not found at {path}; is spyreccl-core installed as a wheel "
            "(pip install packages/spyreccl-core)?"
        )
    return str(path)


def cmake_dir() -> str:
    """Directory holding spyrecclConfig.cmake, for ``find_package(spyreccl CONFIG)``.

    Pass it as ``-Dspyreccl_DIR=...`` or append it to ``CMAKE_PREFIX_PATH``.
    """
    return _installed(_PACKAGE_DIR / "lib" / "cmake" / "spyreccl", "the CMake package directory")


def include_dir() -> str:
    """Directory that contains ``spyreccl/spyreccl.h``."""
    return _installed(_PACKAGE_DIR / "include", "the include directory")


def library_path() -> str:
    """Absolute path of the installed ``libspyreccl.so``."""
    lib_dir = _PACKAGE_DIR / "lib"
    exact = lib_dir / "libspyreccl.so"
    if exact.exists():
        return str(exact)
    versioned = sorted(lib_dir.glob("libspyreccl.so.*"))
    if versioned:
        return str(versioned[0])
    return _installed(exact, "the shared library")

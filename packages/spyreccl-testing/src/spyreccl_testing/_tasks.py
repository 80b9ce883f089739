"""How a function travels from the test process to the workers: by reference, not by pickle.

Test functions live in test modules that pytest imports in its own way (rootdir-relative names,
importlib mode...), so pickling them by module name is fragile. A task therefore names the
function by (module name, source file, qualified name): the worker imports the module normally
when that name resolves to the same file, and otherwise loads the file by path under a stable
private name. Loaded modules are cached for the worker's lifetime, so module-level setup runs
once per pool, not once per task.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_PRIVATE_PREFIX = "_spyreccl_testing_task_"
_loaded: dict[str, ModuleType] = {}


@dataclass(frozen=True)
class FunctionRef:
    module: str
    path: str
    qualname: str

    @classmethod
    def from_callable(cls, fn: Any) -> FunctionRef:
        """Reference to a module-level function (or a static/class attribute reachable by its
        qualified name); rejects what a worker could not find again."""
        target = inspect.unwrap(fn) if callable(fn) else fn
        if not inspect.isfunction(target):
            raise TypeError(
                f"pool.run: expected a module-level function, got {type(fn).__name__} {fn!r} "
                "(bound methods, partials and callable objects cannot be re-imported by the "
                "workers; pass their data as arguments instead)"
            )
        qualname = getattr(fn, "__qualname__", "")
        if "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"pool.run: {qualname} is a lambda or a nested function; workers import the "
                "function by name, so define it at module level"
            )
        path = inspect.getsourcefile(target) or getattr(target.__code__, "co_filename", "")
        if not path or not os.path.exists(path):
            raise TypeError(f"pool.run: cannot locate the source file of {qualname}")
        return cls(fn.__module__ or "", os.path.realpath(path), qualname)

    def describe(self) -> str:
        return f"{os.path.basename(self.path)}::{self.qualname}"

    def resolve(self) -> Any:
        """The function itself, loaded the way the workers load tasks (test files by path,
        with assertion rewriting, once per process). Lets a task receive another function as
        an argument: pass FunctionRef.from_callable(fn), call ref.resolve() on the rank."""
        return resolve(self)


def resolve(ref: FunctionRef) -> Any:
    module = _import_module(ref)
    obj: Any = module
    for part in ref.qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(
                f"worker: {ref.qualname} not found in {ref.path} (module {module.__name__}); "
                "was the file edited while the pool was running?"
            ) from None
    return obj


def _same_file(a: str | None, b: str) -> bool:
    return bool(a) and os.path.realpath(a) == b


def _import_module(ref: FunctionRef) -> ModuleType:
    cached = _loaded.get(ref.path)
    if cached is not None:
        return cached
    module = None
    # Test files are always loaded by path, so that their asserts get pytest's rewriting.
    if ref.module and ref.module not in ("__main__", "__mp_main__") and not _is_test_file(ref.path):
        existing = sys.modules.get(ref.module)
        if existing is not None and _same_file(getattr(existing, "__file__", None), ref.path):
            module = existing
        else:
            try:
                spec = importlib.util.find_spec(ref.module)
            except (ImportError, ValueError):
                spec = None
            if spec is not None and _same_file(spec.origin, ref.path):
                module = importlib.import_module(ref.module)
    if module is None:
        module = _load_by_path(ref.path)
    _loaded[ref.path] = module
    return module


def _is_test_file(path: str) -> bool:
    name = os.path.basename(path)
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def _compile_with_assert_rewriting(path: str) -> Any:
    """The module's code with pytest's assertion rewriting (so a failing `assert a == b` on a
    rank reports both values, as in the test process), or None when pytest is unavailable or
    its internal rewriter changed shape: plain asserts still work then."""
    try:
        import ast

        from _pytest.assertion.rewrite import rewrite_asserts

        with open(path, "rb") as f:
            source = f.read()
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path, None)
        return compile(tree, path, "exec", dont_inherit=True)
    except Exception:
        return None


def private_module_name(path: str) -> str:
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    return f"{_PRIVATE_PREFIX}{stem}_{digest}"


def _load_by_path(path: str) -> ModuleType:
    name = private_module_name(path)
    # Like pytest's default import mode: the test's directory is importable, so helper modules
    # next to the test file resolve the same way in the workers.
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"worker: cannot build an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before execution so that dataclasses, pickling and self-imports inside the
    # module find it.
    sys.modules[name] = module
    try:
        code = _compile_with_assert_rewriting(path) if _is_test_file(path) else None
        if code is not None:
            exec(code, module.__dict__)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module

"""Which functional collectives of a compiled spyre graph are waited at once: their
wait_tensor follows with nothing in between that computes, so they may run as synchronous
calls. Read by both wrapper code generators, the Python one (``_inductor.py``) and the C++
one (``_cpp_wrapper.py``), from the wrapper's lines once they are final.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

# Wrapper lines that neither compute nor touch a collective's buffers: what may sit between a
# collective and its wait_tensor for the collective still to count as waited at once.
_IDLE_LINE_PREFIXES = ("#", "assert_size_stride(", "assert_alignment(", "del ")


def _idle_line(line: Any) -> bool:
    from torch._inductor.codegen import wrapper
    from torch._inductor.utils import LineContext

    if isinstance(line, LineContext):  # origin information for the lines that follow
        return True
    if isinstance(line, str):
        text = line.strip()
        return not text or text.startswith(_IDLE_LINE_PREFIXES)
    return isinstance(line, _idle_line_types(wrapper))


@functools.cache
def _idle_line_types(wrapper: Any) -> tuple[type, ...]:
    # Allocations, frees, reuses and reinterpreting views (MemoryPlanningLine), comments,
    # size asserts; looked up by name, so that a torch without one of them still compiles.
    names = ("CommentLine", "MemoryPlanningLine", "FreeLine", "AssertSizeStrideLine")
    return tuple(t for t in (getattr(wrapper, n, None) for n in names) if isinstance(t, type))


def waited_at_once_or_none(lines: list[Any]) -> set[str]:
    """_waited_at_once(lines), or no collective at all if that fails (inductor's internals
    moved): a warning, never a failed compile. For the Python and the C++ wrapper."""
    try:
        return _waited_at_once(lines)
    except Exception as error:
        warnings.warn(
            "spyreccl: cannot tell which collectives of a compiled spyre graph are waited at "
            f"once ({type(error).__name__}: {error}); they all keep the functional path",
            RuntimeWarning,
            stacklevel=3,
        )
        return set()


def _waited_at_once(lines: list[Any]) -> set[str]:
    """Names of the functional collectives in ``lines`` (a wrapper's lines, in order) whose
    wait_tensor comes next, with only idle lines (and the collective's own output
    unpacking) in between. No computation of the graph can overlap such a collective, so
    it may run as a synchronous call (``_direct_op(..., wait_follows=True)``). Anything
    else in between — a kernel, another collective, a wait on something else — and the
    collective keeps the functional path, whose transfers overlap that work."""
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper

    found: set[str] = set()
    for index, line in enumerate(lines):
        node = getattr(line, "node", None)
        if (
            not isinstance(line, wrapper.ExternKernelAllocLine)
            or not isinstance(node, ir._CollectiveKernel)
            or isinstance(node, ir._WaitKernel)
        ):
            continue
        written = {node.get_name(), *node.get_mutation_names()}
        schema = getattr(node.op_overload, "_schema", None)
        if schema is not None and schema.is_mutable:
            # In-place forms (all_reduce_, broadcast_, ..._out): inductor lists the tensors
            # they write among their inputs, and their waits take those tensors.
            written.update(i.get_name() for i in node.inputs if isinstance(i, ir.IRNode))
        for later in lines[index + 1 :]:
            if isinstance(later, wrapper.MultiOutputLine) and later.arg_name in written:
                written.add(later.result_name)
                continue
            if _idle_line(later):
                continue
            wait = getattr(later, "node", None)
            if isinstance(later, wrapper.ExternKernelAllocLine) and isinstance(
                wait, ir._WaitKernel
            ):
                waited = {i.get_name() for i in wait.inputs if isinstance(i, ir.IRNode)}
                if waited & written:
                    found.add(node.get_name())
            break
    return found

"""``spyreccl_torch._C._direct_op``: how spyre's inductor wrappers call the functional
collectives (src/backend/direct_ops.cpp).

A bound function must be indistinguishable from calling the OpOverload except in speed: the
same dispatcher operator (dispatch modes and the profiler see it), the same result object,
and for everything it does not convert itself (``__torch_function__`` modes and subclasses,
arguments of other types, unknown keywords) the OpOverload's own behaviour and errors.
Collectives on real groups through these functions are checked against float64 references
in test_funcol_fast_path.py (the ``direct`` cases) and in compiled graphs in
test_compile_collectives.py; these single-process checks need no group.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from spyreccl_testing.inputs import fresh_seed
from spyreccl_torch._C import _direct_op

C10D = torch.ops._c10d_functional
WAIT = C10D.wait_tensor.default
DEVICES = ["cpu", "spyre"]
_OVERLOAD_CALL = torch._ops.OpOverload.__call__.__code__


def _tensor(device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(fresh_seed())
    return torch.randn(7, generator=gen).to(device)


def _overload_calls(fn) -> int:
    """How many OpOverload.__call__ frames run during fn() on this thread."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code is _OVERLOAD_CALL:
            count += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return count


def _functional_overloads():
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("_c10d_functional::"):
            packet = getattr(C10D, name.split("::")[1])
            for overload in packet.overloads():
                yield getattr(packet, overload)


def test_binds_every_functional_collective_it_can_convert():
    bound = {str(o): _direct_op(o) for o in _functional_overloads()}
    # batch_p2p_ops takes a str[]: not converted, handed back.
    handed_back = sorted(
        name for name, fn in bound.items() if isinstance(fn, torch._ops.OpOverload)
    )
    assert handed_back == ["_c10d_functional.batch_p2p_ops.default"], handed_back
    for name in (
        "all_reduce_",
        "all_reduce",
        "all_reduce_coalesced_",
        "all_gather_into_tensor",
        "all_gather_into_tensor_out",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "broadcast_",
        "wait_tensor",
    ):
        fn = bound[f"_c10d_functional.{name}.default"]
        assert callable(fn) and not isinstance(fn, torch._ops.OpOverload), name


def test_other_schemas_are_handed_back():
    # Scalar, optional and float arguments are not converted.
    for overload in (torch.ops.aten.add.Tensor, torch.ops.aten.sum.dim_IntList):
        assert _direct_op(overload) is overload


@pytest.mark.parametrize("device", DEVICES)
def test_wait_tensor_without_work_returns_its_input_without_python_operator_calls(device):
    fn = _direct_op(WAIT)
    t = _tensor(device)
    before = t.clone()
    results = []
    assert _overload_calls(lambda: results.append(fn(t))) == 0
    assert results[0] is t
    torch.testing.assert_close(t, before, rtol=0, atol=0)
    # keyword form, by the schema's argument name
    assert _overload_calls(lambda: results.append(fn(tensor=t))) == 0
    assert results[1] is t


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_modes_and_the_profiler_see_the_operator(device):
    seen: list[str] = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    fn = _direct_op(WAIT)
    t = _tensor(device)
    with Recording():
        assert fn(t) is t or torch.equal(fn(t), t)
    assert "_c10d_functional.wait_tensor.default" in seen, seen
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(t)
    assert "_c10d_functional::wait_tensor" in {e.name for e in prof.events()}


def test_torch_function_modes_and_subclasses_get_torchs_call():
    seen: list[object] = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(("sub", func))
            return super().__torch_function__(func, types, args, kwargs)

    fn = _direct_op(WAIT)
    t = _tensor("spyre")
    with Recording():
        assert _overload_calls(lambda: fn(t)) >= 1  # the mode calls it again
    assert WAIT in seen, seen
    seen.clear()
    sub = t.as_subclass(Sub)
    assert _overload_calls(lambda: fn(sub)) >= 1
    assert ("sub", WAIT) in seen, seen


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((3,), {}),  # not a tensor
        (("x",), {}),
        ((), {}),  # missing argument
        (None, {"bogus": 1}),  # unknown keyword
        (None, {"tensor": None}),  # given twice
        (None, {"extra": None}),
    ],
    ids=["int", "str", "missing", "unknown-keyword", "twice", "extra-keyword"],
)
def test_calls_it_cannot_convert_raise_torchs_own_error(args, kwargs):
    t = _tensor("spyre")
    args = (t,) if args is None else args
    kwargs = {k: (t if v is None else v) for k, v in kwargs.items()}
    with pytest.raises(Exception) as expected:
        WAIT(*args, **kwargs)
    with pytest.raises(type(expected.value)) as got:
        _direct_op(WAIT)(*args, **kwargs)
    assert str(got.value) == str(expected.value)


def test_too_many_arguments_and_bad_strings_raise_torchs_own_error():
    fn = _direct_op(C10D.all_reduce_.default)
    t = _tensor("spyre")
    for args in ((t, "sum", "0", "extra"), (t, 5, "0"), (t, "sum\udc80", "0")):
        with pytest.raises(Exception) as expected:
            C10D.all_reduce_.default(*args)
        with pytest.raises(type(expected.value)) as got:
            fn(*args)
        assert str(got.value) == str(expected.value), args


def test_an_unknown_group_raises_as_torch_does():
    """A group name no process group has: the operator's own error, on the calling rank."""
    fn = _direct_op(C10D.all_reduce_.default)
    t = _tensor("spyre")
    with pytest.raises(Exception) as expected:
        C10D.all_reduce_.default(t, "sum", "no-such-group")
    with pytest.raises(type(expected.value)) as got:
        fn(t, "sum", "no-such-group")
    assert str(got.value) == str(expected.value)
    assert "no-such-group" in str(got.value)

"""Recurrent layers on spyre: nn.LSTM, nn.GRU and their cell modules.

ATen runs LSTM and GRU cells on any non-CPU device through the fused cell ops
(aten::_thnn_fused_{lstm,gru}_cell and their backward ops), which spyre implements
(src/device/rnn.cc). Each case runs a module on spyre in float32 and the same module (same
weights) on the CPU in float64, on fresh random inputs, and compares the outputs, the final
states, the input gradient and every parameter gradient of a loss that weights each output
element differently (so a transposed or misplaced gradient cannot cancel out).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from spyreccl_torch import device as spyre_device

pytestmark = pytest.mark.skipif(
    not spyre_device.register(), reason="the emulated spyre device stepped aside"
)

SPYRE = torch.device("spyre")


def _rand(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape))


def _weights(t: torch.Tensor) -> torch.Tensor:
    """Distinct weights per element for the loss, independent of the device."""
    return torch.linspace(-1.0, 2.0, t.numel(), dtype=torch.float64).view(t.shape)


def _run(module, x, state, device, dtype, packed_lengths=None):
    """Forward + backward of `module` (a copy) on `device` in `dtype`: (outputs, final states,
    input gradient, gradients of the parameters and of the initial states), all as float64
    CPU tensors."""
    m = copy.deepcopy(module).to(device, dtype)
    xx = x.to(device, dtype).requires_grad_()
    args = [xx]
    states = []  # initial states, whose gradients are compared too
    if state is not None:
        states = [
            s.to(device, dtype).requires_grad_()
            for s in (state if isinstance(state, tuple) else (state,))
        ]
        args.append(tuple(states) if isinstance(state, tuple) else states[0])
    if packed_lengths is not None:
        args[0] = pack_padded_sequence(xx, packed_lengths, batch_first=True, enforce_sorted=False)
    out = m(*args)
    if isinstance(m, torch.nn.LSTMCell):
        output, finals = out[0], [out[1]]  # (h, c): h is the output
    elif isinstance(m, torch.nn.GRUCell):
        output, finals = out, []
    else:
        output, final = out  # output, h_n or (h_n, c_n)
        finals = list(final) if isinstance(final, tuple) else [final]
    if packed_lengths is not None:
        output, _ = pad_packed_sequence(output, batch_first=True)
    loss = (output.double() * _weights(output).to(output.device)).sum()
    for k, f in enumerate(finals):
        loss = loss + (f.double() * _weights(f).to(f.device) * (k + 2)).sum()
    loss.backward()
    grads = {n: p.grad.cpu().double() for n, p in m.named_parameters()}
    grads.update({f"initial state {k}": s.grad.cpu().double() for k, s in enumerate(states)})
    return (
        output.detach().cpu().double(),
        [f.detach().cpu().double() for f in finals],
        xx.grad.cpu().double(),
        grads,
    )


CASES = {
    "lstm-2layer-bidirectional-batch-first": lambda: torch.nn.LSTM(
        5, 7, num_layers=2, bidirectional=True, batch_first=True
    ),
    "lstm-no-bias": lambda: torch.nn.LSTM(5, 7, bias=False),
    "lstm-proj": lambda: torch.nn.LSTM(5, 8, proj_size=3, batch_first=True),
    "gru-2layer-bidirectional": lambda: torch.nn.GRU(5, 7, num_layers=2, bidirectional=True),
    "gru-no-bias-batch-first": lambda: torch.nn.GRU(5, 7, bias=False, batch_first=True),
    "lstm-cell": lambda: torch.nn.LSTMCell(5, 7),
    "gru-cell": lambda: torch.nn.GRUCell(5, 7, bias=False),
}


def _inputs(name: str, module, rng):
    batch, steps = 3, 4
    hidden = module.hidden_size
    if "cell" in name:
        x = _rand(rng, batch, 5)
        if isinstance(module, torch.nn.LSTMCell):
            return x, (_rand(rng, batch, hidden), _rand(rng, batch, hidden))
        return x, _rand(rng, batch, hidden)
    first = (batch, steps) if module.batch_first else (steps, batch)
    return _rand(rng, *first, 5), None


@pytest.mark.parametrize("name", sorted(CASES))
def test_recurrent_module_matches_cpu_float64(rng, name):
    torch.manual_seed(int(rng.integers(1 << 31)))
    module = CASES[name]()
    x, state = _inputs(name, module, rng)
    got = _run(module, x, state, SPYRE, torch.float32)
    want = _run(module, x, state, "cpu", torch.float64)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
    assert got[3].keys() == want[3].keys()
    for key in want[3]:
        torch.testing.assert_close(got[3][key], want[3][key], rtol=1e-4, atol=1e-5, msg=key)


def test_packed_sequences_of_different_lengths(rng):
    torch.manual_seed(int(rng.integers(1 << 31)))
    module = torch.nn.LSTM(5, 6, num_layers=2, batch_first=True)
    x = _rand(rng, 4, 6, 5)
    lengths = torch.tensor([6, 2, 5, 3])
    got = _run(module, x, None, SPYRE, torch.float32, packed_lengths=lengths)
    want = _run(module, x, None, "cpu", torch.float64, packed_lengths=lengths)
    for g, w in zip((got[0], *got[1], got[2]), (want[0], *want[1], want[2]), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for key in want[3]:
        torch.testing.assert_close(got[3][key], want[3][key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_double_backward(rng, kind):
    """create_graph=True differentiates torch's composite cell backward (not the fused
    backward ops): a gradient-norm penalty's gradient matches CPU float64."""

    def penalty_grad(device, dtype):
        cell = copy.deepcopy(template).to(device, dtype)
        x = inputs.to(device, dtype).requires_grad_()
        out = cell(x)
        h = out[0] if isinstance(out, tuple) else out
        (gx,) = torch.autograd.grad((h * h).sum(), x, create_graph=True)
        (gx.pow(2).sum()).backward()
        return x.grad.cpu().double(), {n: p.grad.cpu().double() for n, p in cell.named_parameters()}

    torch.manual_seed(int(rng.integers(1 << 31)))
    template = (torch.nn.LSTMCell if kind == "lstm" else torch.nn.GRUCell)(4, 5)
    inputs = _rand(rng, 3, 4)
    got, want = penalty_grad(SPYRE, torch.float32), penalty_grad("cpu", torch.float64)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], rtol=1e-4, atol=1e-5, msg=key)


def test_fused_cell_ops_reject_mismatched_shapes():
    gates = torch.zeros(2, 8, device=SPYRE)
    with pytest.raises(RuntimeError, match="input_gates and hidden_gates"):
        torch.ops.aten._thnn_fused_lstm_cell(gates, torch.zeros(2, 4, device=SPYRE), gates[:, :2])
    with pytest.raises(RuntimeError, match=r"the state must be \(batch, hidden\)"):
        torch.ops.aten._thnn_fused_gru_cell(
            torch.zeros(2, 9, device=SPYRE), torch.zeros(2, 9, device=SPYRE), gates[:, :2]
        )

"""Scaled-dot-product attention on spyre.

Spyre's SDPA takes the fused "efficient attention" path (src/device/attention.cc): it must
match CPU SDPA (forward and backward; causal, float and boolean masks, scale, dropout) and
fall back to the math path where the fused kernel does not apply (grouped-query attention,
3-D inputs, sdpa_kernel(MATH)). Under tensor parallelism, q/k/v DTensors sharded on the head
dimension (Megatron-style ColwiseParallel projections whose outputs stay DTensors) go through
DTensor's sharding rule for that op, with or without a plain attention mask; forward and
backward are compared with a single-process float64 reference. Under context parallelism
(ring attention), each rank's backward runs once per block of keys and values with the
log-sum-exp and output merged over every block: the kernel must differentiate through what
it is given (checked alone, block by block, and in context_parallel on 2 and 3 ranks).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from spyreccl_testing.inputs import fresh_seed

SPYRE = "spyre"
B, H, L, S, E = 2, 4, 7, 9, 8


def _qkv(gen: torch.Generator, heads_kv: int = H, s: int = S) -> list[torch.Tensor]:
    return [
        torch.randn(B, H, L, E, generator=gen, dtype=torch.float64),
        torch.randn(B, heads_kv, s, E, generator=gen, dtype=torch.float64),
        torch.randn(B, heads_kv, s, E + 2, generator=gen, dtype=torch.float64),
    ]


def _run(device: str, dtype: torch.dtype, inputs: list[torch.Tensor], grad: torch.Tensor, **kw):
    """SDPA output and input gradients on `device` in `dtype`, as float64 CPU tensors."""
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in inputs]
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = F.scaled_dot_product_attention(*leaves, **kw)
    out.backward(grad.to(device, dtype))
    return out, [out.detach().cpu().double()] + [t.grad.cpu().double() for t in leaves]


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "float_mask": {"attn_mask": "float"},
    "bool_mask": {"attn_mask": "bool"},
    "scale": {"scale": 0.37},
    "causal_scale": {"is_causal": True, "scale": 1.7},
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_matches_cpu(case, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    inputs = _qkv(gen)
    kw = dict(CASES[case])
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(L, S, generator=gen, dtype=torch.float64).to(dtype)
    elif kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(B, 1, L, S, generator=gen) > 0.3
    grad = torch.randn(B, H, L, E + 2, generator=gen, dtype=torch.float64)
    # Reference: CPU SDPA in float64 (from the inputs rounded to `dtype`, as spyre sees them).
    ref_inputs = [t.to(dtype).double() for t in inputs]
    ref_kw = {
        k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in kw.items()
    }
    _, expected = _run("cpu", torch.float64, ref_inputs, grad.to(dtype).double(), **ref_kw)
    out, got = _run(SPYRE, dtype, inputs, grad, **kw)
    assert "EfficientAttention" in type(out.grad_fn).__name__, out.grad_fn
    # float64: exact up to summation order. float32: ~1e-6 relative per product, sums of
    # O(10) terms. bfloat16: inputs are exact (rounded before both runs), spyre computes in
    # float32 and rounds the results once to bfloat16 (2**-8 relative).
    # The absolute part scales with the tensor's largest magnitude: an element that is the
    # small difference of large terms (a gradient through a peaked softmax) carries the
    # terms' rounding error, not its own (one float32 grad k element in 576 was 2.6e-5 off
    # a 2e-5 bound with seed 5403311369565002375).
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for name, g, e in zip(["output", "grad q", "grad k", "grad v"], got, expected):
        atol = tol * max(1.0, e.abs().max().item())
        torch.testing.assert_close(
            g, e, rtol=tol, atol=atol, msg=lambda m, n=name: f"{n} ({case}, seed {seed}): {m}"
        )


def test_math_fallbacks_match_cpu():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    # Grouped-query attention (2 kv heads for 4 query heads) takes the math path.
    inputs = _qkv(gen, heads_kv=2)
    grad = torch.randn(B, H, L, E + 2, generator=gen, dtype=torch.float64)
    out, got = _run(SPYRE, torch.float64, inputs, grad, enable_gqa=True, is_causal=True)
    _, expected = _run("cpu", torch.float64, inputs, grad, enable_gqa=True, is_causal=True)
    assert "EfficientAttention" not in type(out.grad_fn).__name__
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=f"gqa (seed {seed})")
    # Explicitly requested math path, and 3-D inputs.
    inputs = _qkv(gen)
    with sdpa_kernel(SDPBackend.MATH):
        out, got = _run(SPYRE, torch.float64, inputs, grad)
    assert "EfficientAttention" not in type(out.grad_fn).__name__
    _, expected = _run("cpu", torch.float64, inputs, grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    three_d = [t[0] for t in inputs]
    out3 = F.scaled_dot_product_attention(*[t.to(SPYRE) for t in three_d])
    torch.testing.assert_close(out3.cpu(), F.scaled_dot_product_attention(*three_d))


def test_fully_masked_rows_give_zeros_like_cpu():
    gen = torch.Generator().manual_seed(fresh_seed())
    q, k, v = _qkv(gen)
    mask = torch.ones(L, S, dtype=torch.bool)
    mask[2] = False  # query 2 may attend to nothing
    out = F.scaled_dot_product_attention(
        q.to(SPYRE), k.to(SPYRE), v.to(SPYRE), attn_mask=mask.to(SPYRE)
    )
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.cpu(), expected)
    assert out[:, :, 2].abs().max().item() == 0


def test_dropout_is_reproducible_and_its_gradient_is_exact():
    """The dropout mask comes from the spyre Philox stream; the backward rebuilds the same
    mask from the (seed, offset) the forward returned: gradcheck against finite differences
    of the forward (reseeded each call) in float64."""
    gen = torch.Generator().manual_seed(fresh_seed())
    q, k, v = [t[:1, :2, :4, :3].to(SPYRE).requires_grad_() for t in _qkv(gen)]
    seed = fresh_seed()

    def attention(q, k, v):
        torch.spyre.manual_seed(seed)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.4)

    a, b = attention(q, k, v), attention(q, k, v)
    assert torch.equal(a.cpu(), b.cpu())
    with torch.no_grad():
        assert not torch.equal(
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.4).cpu(),
            F.scaled_dot_product_attention(q, k, v).cpu(),
        )
    assert torch.autograd.gradcheck(attention, (q, k, v))


# --- the op called directly ----------------------------------------------------------------
#
# The kernels compute on CPU tensors lent from the spyre ones, under one scope for the whole
# call (attention.cc). These tests pin what that must not change: the numbers (bit for bit
# those of the same formula run with CPU's kernels, and close to a float64 reference), the
# layouts the op's meta function declares, the device of every result, and the memory.

EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward
# Odd sizes everywhere: batch, heads, queries, keys, head dim, value head dim.
OB, OH, OL, OS, OE, OEV = 3, 5, 7, 11, 6, 9


def _kernel_formula(q, k, v, bias, is_causal, scale):
    """attention.cc's forward as CPU operators, in its order (output, log-sum-exp)."""
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)).mul_(scale)
    if is_causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        scores.masked_fill_(keep.logical_not(), -math.inf)
    if bias is not None:
        if bias.dtype == torch.bool:
            bias = torch.zeros_like(bias, dtype=acc).masked_fill_(bias.logical_not(), -math.inf)
        scores.add_(bias.to(acc))
    lse = torch.logsumexp(scores, -1)
    probs = (scores - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1)).exp_()
    return torch.matmul(probs, v.to(acc)).to(q.dtype), lse


def _float64_attention(q, k, v, bias, is_causal, scale):
    """An independent reference: softmax attention in float64 (output, log-sum-exp)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), -math.inf)
    if bias is not None:
        scores = scores.masked_fill(~bias, -math.inf) if bias.dtype == torch.bool else scores + bias
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _direct_inputs(gen, dtype, bias_kind):
    q = torch.randn(OB, OH, OL, OE, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(OB, OH, OS, OE, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(OB, OH, OS, OEV, generator=gen, dtype=torch.float64).to(dtype)
    # q and k as the decode step passes them: q a transposed view, k non-contiguous.
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.randn(OB, OS, OH, OE, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
    bias = None
    if bias_kind == "float":
        bias = torch.randn(OB, 1, OL, OS, generator=gen, dtype=torch.float64).to(dtype)
    elif bias_kind == "bool":
        bias = torch.rand(OB, OH, OL, OS, generator=gen) > 0.3
        bias[..., 0] = True  # every query sees a key (the float64 softmax has no safe rows)
    return q, k, v, bias


def _spyre_bytes(device):
    torch.spyre.synchronize(device)
    return torch.spyre.memory_allocated(device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("bias_kind", "is_causal", "scale"),
    [(None, False, None), (None, True, 0.3), ("float", False, None), ("bool", True, 1.3)],
)
@pytest.mark.parametrize("compute_log_sumexp", [False, True])
def test_efficient_attention_forward_is_the_formula_on_cpu(
    dtype, bias_kind, is_causal, scale, compute_log_sumexp
):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q, k, v, bias = _direct_inputs(gen, dtype, bias_kind)
    sq, sk, sv = (t.to(SPYRE) for t in (q, k, v))
    sbias = None if bias is None else bias.to(SPYRE)
    before = _spyre_bytes(sq.device)
    out, lse, philox_seed, philox_offset = EFFICIENT(
        sq, sk, sv, sbias, compute_log_sumexp, 0.0, is_causal, scale=scale
    )
    what = f"{dtype}, bias {bias_kind}, causal {is_causal}, seed {seed}"
    assert {t.device for t in (out, lse, philox_seed, philox_offset)} == {sq.device}, what
    # The meta function's layouts: output (B, H, L, Ev) over (B, L, H, Ev) memory, float32
    # log-sum-exp padded to 32 queries with +inf (or empty), 0-d int64 seed and offset.
    assert out.shape == (OB, OH, OL, OEV) and out.dtype == dtype, what
    assert out.stride() == (OL * OH * OEV, OEV, OH * OEV, 1), what
    assert philox_seed.shape == () and philox_seed.dtype == torch.int64
    assert philox_offset.shape == () and philox_offset.dtype == torch.int64
    want_out, want_lse = _kernel_formula(q, k, v, bias, is_causal, scale)
    # Bit for bit: the same operators, run by CPU's kernels.
    assert torch.equal(out.cpu(), want_out), what
    if compute_log_sumexp:
        assert lse.shape == (OB, OH, 32) and lse.dtype == torch.float32, what
        assert torch.equal(lse.cpu()[..., :OL], want_lse.float()), what
        assert torch.isposinf(lse.cpu()[..., OL:]).all(), what
    else:
        assert lse.shape == (OB, OH, 0) and lse.dtype == torch.float32, what
    # And close to softmax attention in float64 (from the inputs as spyre saw them).
    ref_out, ref_lse = _float64_attention(q, k, v, bias, is_causal, scale)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    torch.testing.assert_close(
        out.cpu().double(), ref_out, rtol=tol[dtype], atol=tol[dtype], msg=what
    )
    if compute_log_sumexp:
        torch.testing.assert_close(
            lse.cpu()[..., :OL].double(), ref_lse, rtol=1e-6, atol=1e-6, msg=what
        )
    # The results are adopted spyre memory, released with them; nothing else stays behind.
    del out, lse, philox_seed, philox_offset
    assert _spyre_bytes(sq.device) == before, what


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_on", [SPYRE, "cpu"])
def test_efficient_attention_backward_matches_float64_autograd(dtype, bias_on):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q, k, v, bias = _direct_inputs(gen, dtype, "float")
    dout = torch.randn(OB, OH, OL, OEV, generator=gen, dtype=torch.float64).to(dtype)
    sq, sk, sv, sd = (t.to(SPYRE) for t in (q, k, v, dout))
    sbias = bias.expand(OB, OH, OL, OS).to(bias_on)
    out, lse, philox_seed, philox_offset = EFFICIENT(sq, sk, sv, sbias, True, 0.0, False)
    grads = EFFICIENT_BACKWARD(
        sd, sq, sk, sv, sbias, out, lse, philox_seed, philox_offset, 0.0,
        [True, True, True, True], False,
    )  # fmt: skip
    leaves = [t.double().requires_grad_() for t in (q, k, v, bias.expand(OB, OH, OL, OS))]
    ref, _ = _float64_attention(*leaves[:3], leaves[3], False, None)
    ref.backward(dout.double())
    what = f"{dtype}, bias on {bias_on}, seed {seed}"
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for name, got, leaf, like in zip(("q", "k", "v", "bias"), grads, leaves, (sq, sk, sv, sbias)):
        assert got.device == like.device and got.dtype == dtype, f"grad {name}: {what}"
        atol = tol * max(1.0, leaf.grad.abs().max().item())
        torch.testing.assert_close(
            got.cpu().double(), leaf.grad, rtol=tol, atol=atol, msg=f"grad {name}: {what}"
        )
    # The meta function's layouts: q, k, v gradients over (B, L, H, E) memory; the bias
    # gradient's last dimension padded to 16.
    assert grads[0].stride() == (OL * OH * OE, OE, OH * OE, 1), what
    assert grads[1].stride() == (OS * OH * OE, OE, OH * OE, 1), what
    assert grads[2].stride() == (OS * OH * OEV, OEV, OH * OEV, 1), what
    assert grads[3].stride()[-2:] == (16, 1), what


def test_efficient_attention_names_a_cpu_operand():
    gen = torch.Generator().manual_seed(fresh_seed())
    q, k, v, _ = _direct_inputs(gen, torch.float32, None)
    with pytest.raises(
        RuntimeError, match="_scaled_dot_product_efficient_attention: expected spyre"
    ):
        EFFICIENT(q, k.to(SPYRE), v.to(SPYRE), None, False, 0.0, False)


# --- tensor parallel attention (2 ranks) --------------------------------------------------

DIM, HEADS, BATCH, SEQ = 32, 4, 2, 6


class Attention(nn.Module):
    """Ordinary attention code: the head count comes from the projection's output, so the
    same module runs unsharded and with DTensor projections."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x, mask=None, causal=False):
        b, s, _ = x.shape

        def heads(t):
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), attn_mask=mask, is_causal=causal
        )
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def _tp_attention_case(seed: int, variant: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.accelerator.set_device_index(rank)
    torch.manual_seed(seed)
    module = Attention()
    reference = copy.deepcopy(module).double()
    plan = {
        # use_local_output=False: SDPA receives DTensors sharded on the heads dimension.
        "q": ColwiseParallel(use_local_output=False),
        "k": ColwiseParallel(use_local_output=False),
        "v": ColwiseParallel(use_local_output=False),
        "o": RowwiseParallel(),
    }
    tp = parallelize_module(module.to(SPYRE), init_device_mesh(SPYRE, (ws,)), plan)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    grad = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    mask = None
    if variant == "mask":
        mask = torch.randn(BATCH, 1, SEQ, SEQ, generator=gen, dtype=torch.float64)
    elif variant == "bool_mask":
        mask = torch.rand(SEQ, SEQ, generator=gen) > 0.4
        mask.fill_diagonal_(True)
    causal = variant == "causal"

    seen = {}
    original = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        seen["q"] = q
        return original(q, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        x_dev = x.float().to(SPYRE).requires_grad_()
        mask_dev = (
            None
            if mask is None
            else mask.to(SPYRE, torch.float32 if mask.is_floating_point() else torch.bool)
        )
        out = tp(x_dev, mask_dev, causal)
        out.backward(grad.float().to(SPYRE))
    finally:
        F.scaled_dot_product_attention = original
    q = seen["q"]
    assert isinstance(q, DTensor) and q.placements == (Shard(1),), (
        "SDPA must see head-sharded DTensors"
    )
    assert q.to_local().shape[1] * ws == HEADS

    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref, mask, causal)
    out_ref.backward(grad)
    msg = f"(rank {rank}, seed {seed}, {variant})"
    # float32 against float64: a handful of roundings on O(1) values.
    torch.testing.assert_close(
        out.detach().cpu().double(), out_ref.detach(), rtol=1e-5, atol=1e-5, msg=f"output {msg}"
    )
    torch.testing.assert_close(
        x_dev.grad.cpu().double(), x_ref.grad, rtol=1e-5, atol=1e-5, msg=f"grad x {msg}"
    )
    ref_params = dict(reference.named_parameters())
    for name, p in tp.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(
            g.cpu().double(), ref_params[name].grad, rtol=1e-5, atol=1e-5, msg=f"grad {name} {msg}"
        )


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("variant", ["causal", "mask", "bool_mask", "plain"])
def test_tensor_parallel_attention_matches_reference(rank_pool, variant):
    rank_pool.run(_tp_attention_case, fresh_seed(), variant)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_of_a_block_of_keys_uses_the_merged_log_sum_exp(dtype, is_causal):
    # Ring attention's backward: keys and values in two blocks, each block's backward given
    # the output and log-sum-exp of attention over both. The blocks' shares must add up to
    # the whole gradient (dq), and give each block's slice of dk and dv.
    gen = torch.Generator().manual_seed(fresh_seed())
    q = torch.randn(B, H, 40, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, 40, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, 40, E + 2, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, H, 40, E + 2, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, is_causal=is_causal).backward(dout)
    want = [t.grad for t in leaves]

    sq, sk, sv, sd = (t.to(SPYRE, dtype) for t in (q, k, v, dout))
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    out, lse, seed, offset = efficient(sq, sk, sv, None, True, 0.0, is_causal)
    grads = []
    for block in (slice(0, 24), slice(24, 40)):
        # With a causal mask, the second block's keys are masked for the first 24 queries:
        # its scores come from a bias (what ring attention's steps amount to).
        bias = None
        if is_causal:
            keep = torch.ones(40, 40, dtype=torch.bool).tril()[:, block]
            bias = torch.zeros(40, keep.shape[1], dtype=dtype).masked_fill(~keep, -math.inf)
            bias = bias.expand(B, H, 40, keep.shape[1]).to(SPYRE)
        grads.append(
            torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                sd,
                sq,
                sk[:, :, block],
                sv[:, :, block],
                bias,
                out,
                lse,
                seed,
                offset,
                0.0,
                [True, True, True, False],
                False,
            )
        )
    # The op's log-sum-exp is float32 whatever the inputs: a merged one costs float64 inputs
    # their precision (the forward's own does not, see attention.cc).
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    dq = grads[0][0].cpu().double() + grads[1][0].cpu().double()
    torch.testing.assert_close(dq, want[0], **tol, msg="dq: the blocks' shares")
    for i, block in enumerate((slice(0, 24), slice(24, 40))):
        torch.testing.assert_close(grads[i][1].cpu().double(), want[1][:, :, block], **tol)
        torch.testing.assert_close(grads[i][2].cpu().double(), want[2][:, :, block], **tol)


def _context_parallel_case(seed: int, ctx) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    world = ctx.world_size
    torch.accelerator.set_device_index(ctx.rank)
    mesh = init_device_mesh(SPYRE, (world,))
    gen = torch.Generator().manual_seed(seed)
    # Each rank holds two chunks of the sequence (load balancing); a chunk's log-sum-exp is
    # padded to 32 queries, so each chunk must be a multiple of 32 queries (as on CUDA).
    seq = 64 * world
    q, k, v, dout = (torch.randn(B, H, seq, E, generator=gen, dtype=torch.float64) for _ in "qkvd")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    want_out.backward(dout)

    buffers = [t.float().to(f"{SPYRE}:{ctx.rank}") for t in (q, k, v, dout)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
        local = [t.detach().requires_grad_() for t in buffers[:3]]
        out = F.scaled_dot_product_attention(*local, is_causal=True)
        out.backward(buffers[3])
        got = context_parallel_unshard(mesh, [out.detach()] + [t.grad for t in local], [2] * 4)
    what = f"seed {seed}, rank {ctx.rank} of {world}"
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, [want_out] + [t.grad for t in leaves]):
        torch.testing.assert_close(
            g.cpu().double(), w.detach(), rtol=1e-4, atol=2e-5, msg=f"{name}: {what}"
        )


@pytest.mark.world_sizes(2, 3)
def test_context_parallel_attention_matches_reference(rank_pool):
    rank_pool.run(_context_parallel_case, fresh_seed(), timeout=120)


def _checkpointed_attention(q, k, v, dropout_p=0.0):
    from torch.utils.checkpoint import checkpoint

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p) * 2

    return checkpoint(attention, q, k, v, use_reentrant=False)


def test_compiled_checkpointed_attention_matches_eager():
    """Inductor with activation checkpointing: spyre's efficient attention (a seeded op) is
    decomposed for inductor, so the compiled forward and backward match eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(fresh_seed())
    inputs = [t.float() for t in _qkv(gen)]
    grad = torch.randn(B, H, L, E + 2, generator=gen)
    eager = [t.to(SPYRE).requires_grad_() for t in inputs]
    compiled = [t.to(SPYRE).requires_grad_() for t in inputs]
    out = _checkpointed_attention(*eager)
    out.backward(grad.to(SPYRE))
    out_c = torch.compile(_checkpointed_attention, backend="inductor", fullgraph=True)(*compiled)
    out_c.backward(grad.to(SPYRE))
    torch.testing.assert_close(out_c.cpu(), out.detach().cpu(), rtol=1e-5, atol=1e-5)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad.cpu(), b.grad.cpu(), rtol=1e-5, atol=1e-5)


def test_compiled_checkpointed_dropout_replays_the_same_mask():
    """With dropout, the recomputation in the backward must draw the forward's mask (spyre is
    a graph-safe RNG device). The output is linear in v, so <out, g> == <v, dL/dv> holds
    exactly when the backward used the forward's mask, and fails for any other mask."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(fresh_seed())
    q, k, v = [t.to(SPYRE).requires_grad_() for t in _qkv(gen)]
    grad = torch.randn(B, H, L, E + 2, generator=gen, dtype=torch.float64).to(SPYRE)
    fn = torch.compile(
        lambda q, k, v: _checkpointed_attention(q, k, v, dropout_p=0.5), backend="aot_eager"
    )
    out = fn(q, k, v)
    out.backward(grad)
    lhs = (out.detach() * grad).sum().item()
    rhs = (v.detach() * v.grad).sum().item()
    assert math.isclose(lhs, rhs, rel_tol=1e-10, abs_tol=1e-10), (lhs, rhs)
    with torch.no_grad():  # dropout did drop
        assert not torch.allclose(out, _checkpointed_attention(q, k, v))

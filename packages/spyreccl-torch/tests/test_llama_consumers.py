"""A small Llama-style decoder trained on spyre the way PyTorch-native LLM training stacks do
it, on 2 ranks, unpatched: RMSNorm, rotary embeddings, causal SDPA attention, a SwiGLU MLP and
untied input/output embeddings, in three configurations:

1. FSDP2 (``fully_shard`` per block and at the root), each rank training on its slice of the
   global batch;
2. tensor parallelism, Megatron-style (attention q/k/v and MLP w1/w3 column-parallel, wo/w2
   row-parallel, vocabulary-parallel embedding and output), the model code unchanged;
3. ``torch.compile`` (inductor) of tensor-parallel blocks with activation checkpointing, the
   forward under ``torch.autocast("spyre", dtype=torch.bfloat16)``.

Every configuration starts from the weights of one seeded model and sees the same batches as
a single-process reference on the CPU: float64 for 1 and 2 (the spyre run is float32, so
losses and weights agree to ~1e-6 relative), float32 for 3, whose tolerance comes from the
bfloat16 arithmetic itself (see ``_check_bf16_run``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from spyreccl_testing.inputs import fresh_seed

SPYRE = "spyre"
VOCAB, DIM, HEADS, LAYERS, HIDDEN, SEQ, BATCH = 64, 32, 4, 2, 64, 8, 2
STEPS, LR = 3, 0.05

pytestmark = pytest.mark.world_sizes(2)


# --- the model: ordinary single-device code --------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, seq: int, theta: float = 10000.0) -> tuple[torch.Tensor, ...]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)  # (seq, head_dim / 2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates consecutive pairs of x (batch, seq, heads, head_dim) by position-dependent
    angles."""
    pairs = x.unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the same code runs on a column shard (fewer local heads).
        q = apply_rotary(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)  # untied from tok_embeddings
        cos, sin = rotary_tables(DIM // HEADS, SEQ)
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _batches(seed: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(STEPS):
        seq = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _reference(model: Llama, batches, dtype: torch.dtype) -> tuple[list[float], dict]:
    """Single-process CPU training in `dtype` on the whole batches."""
    ref = copy.deepcopy(model).to(dtype)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    losses = []
    for tokens, targets in batches:
        opt.zero_grad()
        loss = _loss(ref(tokens), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in ref.named_parameters()}


def _tp_plan(shard_embeddings: bool = True) -> tuple[dict, dict]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    root = {"output": ColwiseParallel(output_layouts=Replicate())}
    if shard_embeddings:
        root["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        )
    block = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    return root, block


def _tensor_parallel(model: Llama, mesh, shard_embeddings: bool = True) -> Llama:
    from torch.distributed.tensor.parallel import parallelize_module

    root, block = _tp_plan(shard_embeddings)
    for layer in model.layers:
        parallelize_module(layer, mesh, block)
    return parallelize_module(model, mesh, root)


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()


def _train(model: nn.Module, batches, forward=None) -> list[float]:
    # foreach=False: with tensor parallelism the norms' weights stay plain tensors next to
    # DTensor weights, and torch's foreach kernels refuse such mixed lists (on any device).
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)
    losses = []
    for tokens, targets in batches:
        opt.zero_grad()
        logits = (forward or model)(tokens.to(SPYRE))
        loss = _loss(logits, targets.to(SPYRE))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _setup(seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.accelerator.set_device_index(rank)
    torch.manual_seed(seed)
    model = Llama()  # the same initial weights on every rank (CPU generator, same seed)
    return rank, ws, model, init_device_mesh(SPYRE, (ws,))


def _assert_matches(losses, ref_losses, params, ref_params, rtol, atol, what):
    for step, (got, exp) in enumerate(zip(losses, ref_losses)):
        assert math.isclose(got, exp, rel_tol=rtol, abs_tol=atol), (
            f"{what}: step {step} loss {got} vs reference {exp}"
        )
    for name, p in params:
        torch.testing.assert_close(
            _full(p).to(ref_params[name].dtype),
            ref_params[name],
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{what}: {n} after {STEPS} steps: {m}",
        )


# --- 1. FSDP2 ------------------------------------------------------------------------------


def _fsdp2_case(seed: int) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    rank, ws, model, mesh = _setup(seed)
    global_batches = _batches(seed, BATCH * ws)
    ref_losses, ref_params = _reference(model, global_batches, torch.float64)

    model = model.to(SPYRE)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = [
        (t[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH])
        for t, y in global_batches
    ]
    local = torch.tensor(_train(model, mine), dtype=torch.float64, device=SPYRE)
    dist.all_reduce(local, op=dist.ReduceOp.AVG)  # equal slices: mean of means = global mean
    losses = local.cpu().tolist()
    # float32 vs float64 through 2 layers and 3 SGD steps: ~1e-6 relative.
    _assert_matches(losses, ref_losses, model.named_parameters(), ref_params, 2e-5, 1e-6, "FSDP2")
    return losses


def test_fsdp2_training_matches_float64_reference(rank_pool):
    losses = rank_pool.run(_fsdp2_case, fresh_seed())
    assert losses[0] == losses[1] and all(math.isfinite(x) for x in losses[0])


# --- 2. tensor parallel --------------------------------------------------------------------


def _tp_case(seed: int) -> list[float]:
    from torch.distributed.tensor import DTensor, Shard

    _rank, ws, model, mesh = _setup(seed)
    batches = _batches(seed, BATCH)  # TP: every rank sees the whole batch
    ref_losses, ref_params = _reference(model, batches, torch.float64)

    tp = _tensor_parallel(model.to(SPYRE), mesh)
    wq = tp.layers[0].attention.wq.weight
    assert isinstance(wq, DTensor) and wq.placements == (Shard(0),)
    assert wq.to_local().shape[0] * ws == DIM
    losses = _train(tp, batches)
    _assert_matches(losses, ref_losses, tp.named_parameters(), ref_params, 2e-5, 1e-6, "TP")
    return losses


def test_tensor_parallel_training_matches_float64_reference(rank_pool):
    losses = rank_pool.run(_tp_case, fresh_seed())
    assert losses[0] == losses[1] and all(math.isfinite(x) for x in losses[0])


# --- 3. torch.compile + tensor parallel + activation checkpointing + bf16 autocast ----------


def _compiled_case(seed: int) -> dict[str, list[float]]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    _rank, _ws, model, mesh = _setup(seed)
    batches = _batches(seed, BATCH)
    ref_losses, ref_params = _reference(model, batches, torch.float32)
    # The scale of bfloat16's own error: the same reference under CPU bf16 autocast.
    cpu_bf16 = copy.deepcopy(model)
    opt = torch.optim.SGD(cpu_bf16.parameters(), lr=LR, momentum=0.9)
    cpu_losses = []
    for tokens, targets in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = cpu_bf16(tokens)
        loss = _loss(logits, targets)
        loss.backward()
        opt.step()
        cpu_losses.append(loss.item())

    # The embedding stays replicated here: torch 2.13 fails the backward of a compiled
    # tensor-parallel block fed by a RowwiseParallel embedding with Replicate output
    # ("'Tensor' object has no attribute '_local_tensor'" in DTensor's redistribute
    # backward) on every device -- reproduced on CPU with gloo -- so it is not spyre's.
    tp = _tensor_parallel(model.to(SPYRE), mesh, shard_embeddings=False)
    for i, layer in enumerate(tp.layers):
        tp.layers[i] = torch.compile(checkpoint_wrapper(layer), backend="inductor")
    logits_dtypes = []

    def forward(tokens):
        with torch.autocast(SPYRE, dtype=torch.bfloat16):
            logits = tp(tokens)
        logits_dtypes.append(logits.dtype)
        return logits

    losses = _train(tp, batches, forward)
    assert logits_dtypes and all(d == torch.bfloat16 for d in logits_dtypes), logits_dtypes
    _check_bf16_run(
        losses,
        cpu_losses,
        ref_losses,
        dict(tp.named_parameters()),
        {n: p.detach() for n, p in cpu_bf16.named_parameters()},
        ref_params,
    )
    return {"spyre": losses, "cpu_bf16": cpu_losses, "fp32": ref_losses}


def _check_bf16_run(losses, cpu_losses, ref_losses, params, cpu_params, ref_params) -> None:
    """Tolerance from bfloat16 itself: the spyre run (TP, compiled, checkpointed, autocast)
    may differ from the float32 reference by at most 4x the largest deviation that CPU bf16
    autocast of the same model shows from it (over all steps for the losses, over all
    parameters for the weights). The factor leaves room for what tensor parallelism adds
    (bf16 partial products of row-parallel layers are summed across ranks) and for inductor
    reordering float32 accumulations; measured spyre deviations stay within ~2x of CPU's,
    while a wrong gradient moves weights by about a whole update (~1e-3).

    The losses' scale has a floor: CPU's largest loss deviation over three steps is a small,
    heavy-tailed sample. Over ten seeds it ranged from 1.8e-4 to 1.2e-3, while spyre's ranged
    from 2.5e-4 to 8.7e-4. A CPU run whose errors nearly cancelled once set a bound below
    spyre's ordinary rounding (CI, 2026-11-27). The floor, 2^-12 of the loss, is about the
    median CPU deviation. The weights' ratio to CPU is steady (0.8 to 1.3 over those seeds),
    so they keep the unfloored bound. They are also the check that a wrong gradient fails: a
    gradient 1.5x off moves the step-2 loss by only 1e-3 to 3e-3, inside bf16's own noise."""

    def strip(name: str) -> str:
        return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")

    cpu_loss_dev = max(abs(c - r) for c, r in zip(cpu_losses, ref_losses))
    loss_floor = 2.0**-12 * max(abs(r) for r in ref_losses)
    loss_bound = 4 * max(cpu_loss_dev, loss_floor) + 1e-6
    for step, (got, ref) in enumerate(zip(losses, ref_losses)):
        assert abs(got - ref) <= loss_bound, (
            f"bf16 step {step}: loss {got} vs float32 {ref} (bound {loss_bound})"
        )
    cpu_dev = max((cpu_params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    param_bound = 4 * cpu_dev + 1e-6
    for name, p in params.items():
        err = (_full(p).float() - ref_params[strip(name)]).abs().max().item()
        assert err <= param_bound, f"bf16 {strip(name)}: max error {err} vs bound {param_bound}"


def test_compiled_checkpointed_bf16_tensor_parallel_training(rank_pool):
    results = rank_pool.run(_compiled_case, fresh_seed(), timeout=600)
    assert results[0]["spyre"] == results[1]["spyre"]

"""A small Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention with a
static KV cache, a SwiGLU MLP, untied input and output embeddings.

Ordinary single-device code: the number of (query and key/value) heads a layer has is read
from its projections' outputs, never from the config, so the same code runs on a
Megatron-style tensor-parallel shard (:func:`tensor_parallel`), where a rank holds a column
slice of ``wq``/``wk``/``wv``/``w1``/``w3`` (whole heads) and a row slice of ``wo``/``w2``.

The KV cache is static: one ``(batch, local kv heads, max_seq, head_dim)`` tensor pair per
layer, written at *slots* (cache columns) given as a tensor, and attention always spans the
whole cache under a boolean mask. Every decode step therefore has the same shapes and the
same graph, so ``torch.compile`` compiles it once. Prompts of different lengths are
left-padded: all rows share the slot of a step, each row has its own rotary position.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "KVCache",
    "Llama",
    "LlamaConfig",
    "compile_blocks",
    "local_shard_model",
    "manual_tensor_parallel",
    "random_tensor_parallel",
    "rehome_tensor_parallel",
    "tensor_parallel",
    "tp_plan",
]


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 512
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    hidden: int = 0  # 0: Llama's SwiGLU width, 2/3 of 4 * dim rounded up to 64
    max_seq: int = 96
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: dim ({self.dim}) must be a multiple of n_heads ({self.n_heads}) "
                f"and n_heads a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig: head_dim {self.dim // self.n_heads} must be even")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.hidden:
            return self.hidden
        return -(-(8 * self.dim // 3) // 64) * 64

    def check_world_size(self, world_size: int) -> None:
        """Tensor parallelism splits whole heads and the MLP's hidden width evenly."""
        bad = [
            f"{name} ({value})"
            for name, value in (
                ("n_heads", self.n_heads),
                ("n_kv_heads", self.n_kv_heads),
                ("hidden", self.ffn_dim),
            )
            if value % world_size
        ]
        if bad:
            raise ValueError(
                f"LlamaConfig: {', '.join(bad)} not divisible by the tensor-parallel world "
                f"size {world_size}"
            )

    def to_dict(self) -> dict:
        return dict(asdict(self), ffn_dim=self.ffn_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 at least, as Llama does: bf16's 8 bits of mantissa lose the mean square.
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.weight


def rotary_tables(head_dim: int, max_seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), (max_seq, head_dim / 2), float32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates consecutive pairs of ``x`` (batch, seq, heads, head_dim) by the angles of each
    token's position; ``cos``/``sin`` are (batch, seq, head_dim / 2)."""
    pairs = x.unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class KVCache:
    """Per layer one (keys, values) pair of (batch, local kv heads, max_seq, head_dim)."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = layers

    @classmethod
    def for_model(cls, model: Llama, batch: int, device, dtype: torch.dtype) -> KVCache:
        cfg = model.config
        layers = []
        for layer in model.layers:
            kv_heads = _local_rows(layer.attention.wk.weight) // cfg.head_dim
            shape = (batch, kv_heads, cfg.max_seq, cfg.head_dim)
            layers.append(
                (
                    torch.zeros(shape, device=device, dtype=dtype),
                    torch.zeros(shape, device=device, dtype=dtype),
                )
            )
        return cls(layers)


def _local_rows(weight: torch.Tensor) -> int:
    """Output features this rank holds of a (possibly column-sharded) projection."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return local.shape[0]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        slots: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: on a column shard the projections hold fewer (whole) heads.
        q = apply_rotary(self.wq(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rotary(self.wk(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if cache is not None:
            cache_k, cache_v = cache
            cache_k.index_copy_(2, slots, k)
            cache_v.index_copy_(2, slots, v)
            k, v = cache_k, cache_v
        # Grouped-query attention: each key/value head serves a group of query heads (the
        # shard keeps whole groups: rank r holds query heads r*H/n.. and kv heads r*KV/n..).
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, mask, slots, cache) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, slots, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """``forward(tokens)`` for training (causal over the sequence, positions 0..s-1);
    ``forward(tokens, positions, mask, slots, cache)`` for generation (see
    :mod:`spyreccl_torch.models.generate`)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)  # untied from tok_embeddings
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_seed(cls, cfg: LlamaConfig, seed: int) -> Llama:
        """Weights drawn from a CPU generator: the same model on every rank and machine.
        Projections get a 1/sqrt(fan_in) scale so that activations and logits stay of order
        one through the layers (logits well apart make greedy decoding robust to rounding)."""
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif p.dim() == 2 and "tok_embeddings" not in name:
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen))
        return model

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, slots, None if cache is None else cache.layers[i])
        return self.output(self.norm(h))


def tp_plan() -> dict:
    """Megatron-style plan of one block: q/k/v and the MLP's w1/w3 column-parallel (whole
    heads per rank), wo and w2 row-parallel, so each block all-reduces twice (after the
    attention and after the MLP). Embedding and output layer stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def tensor_parallel(model: Llama, mesh) -> Llama:
    """Shards ``model`` (already on the mesh's device) in place with DTensor's
    ``parallelize_module``; returns it."""
    from torch.distributed.tensor.parallel import parallelize_module

    model.config.check_world_size(mesh.size())
    for layer in model.layers:
        parallelize_module(layer, mesh, tp_plan())
    return model


def local_shard_model(tp_model: Llama) -> Llama:
    """The same per-rank computation as ``tp_model`` without any collective: a plain
    ``Llama`` whose projections are this rank's shards (sharing their storage, no copy).
    Its row-parallel outputs are partial sums, so its numbers are wrong; its time is the
    *compute floor* of a tensor-parallel step."""
    cfg = tp_model.config
    with torch.device("meta"):
        floor = Llama(cfg)
    # setattr, not load_state_dict: the shards' shapes are not the modules' declared ones.
    for name, p in tp_model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        local = p.to_local() if hasattr(p, "to_local") else p
        setattr(floor.get_submodule(owner), leaf, nn.Parameter(local.detach(), requires_grad=False))
    floor.rope_cos = tp_model.rope_cos
    floor.rope_sin = tp_model.rope_sin
    return floor


def rehome_tensor_parallel(tp_model: Llama, mesh) -> Llama:
    """``tp_model`` (a :func:`tensor_parallel` model) again, on another ``mesh`` of the same
    shape: the same local shards (sharing their storage, no copy), placements and plan, so
    the same DTensor dispatch, with its collectives going to ``mesh``'s group. Over a group
    whose collectives move nothing, its time is DTensor's eager step without the transfers
    (:func:`spyreccl_torch.bench.decode_timing.transferless_mesh`)."""
    from torch.distributed.tensor import DTensor

    cfg = tp_model.config
    with torch.device("meta"):
        model = Llama(cfg)
    for name, p in tp_model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if isinstance(p, DTensor):
            value = DTensor.from_local(
                p.to_local().detach(), mesh, p.placements, run_check=False, shape=p.shape,
                stride=p.stride(),
            )  # fmt: skip
        else:
            value = p.detach()
        setattr(model.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=False))
    model.rope_cos = tp_model.rope_cos
    model.rope_sin = tp_model.rope_sin
    return tensor_parallel(model, mesh)


def manual_tensor_parallel(
    tp_model: Llama, group_name: str, timeline: list[tuple[int, int, int]] | None = None
) -> Llama:
    """Tensor parallelism without DTensor: :func:`local_shard_model` of ``tp_model`` (the
    same shards, shared) whose row-parallel projections (``wo``, ``w2``) all-reduce their
    partial sums in a forward hook, ``_c10d_functional.all_reduce`` + ``wait_tensor`` over
    the group named ``group_name``: the calls DTensor's ``RowwiseParallel`` makes, and the
    same numbers as ``tp_model``. Its time minus ``tp_model``'s is the cost of DTensor's
    eager dispatch (wrapping, sharding propagation, redistribution) around the same
    computation and collectives.

    With ``timeline``, each all_reduce appends (start ns, end ns, elements) of its call
    (``time.perf_counter_ns``: CLOCK_MONOTONIC, one clock for every process of a machine),
    so that the ranks' records can tell waiting for a late peer from the transfer
    (:func:`spyreccl_torch.bench.decode_timing.in_call_costs`)."""
    model = local_shard_model(tp_model)
    functional = torch.ops._c10d_functional

    def all_reduce(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return functional.wait_tensor(functional.all_reduce(out, "sum", group_name))

    if timeline is not None:
        plain = all_reduce

        def all_reduce(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter_ns()
            result = plain(module, args, out)
            timeline.append((start, time.perf_counter_ns(), out.numel()))
            return result

    for layer in model.layers:
        layer.attention.wo.register_forward_hook(all_reduce)
        layer.feed_forward.w2.register_forward_hook(all_reduce)
    return model


def compile_blocks(model: Llama, **options) -> Llama:
    """A view of ``model`` whose blocks run ``torch.compile``d (the same parameters and
    buffers; ``model`` itself stays eager). Blocks rather than the whole model: the blocks
    share one code object, so dynamo compiles one graph and every layer reuses it, which
    makes compilation several times shorter; the embedding lookup, the final norm and the
    output projection, one op each, stay eager."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.layers = nn.ModuleList(torch.compile(layer, **options) for layer in model.layers)
    return view


def random_tensor_parallel(
    cfg: LlamaConfig, mesh, device: torch.device, dtype: torch.dtype, seed: int
) -> Llama:
    """A tensor-parallel ``Llama`` with random weights made shard by shard on ``device``:
    a rank never holds a whole projection (``tensor_parallel`` of a full model needs the
    full weights on every rank first, 2.8 GB a layer at width 8192 in float32). For
    benchmarks: the weights are not those of :meth:`Llama.from_seed`."""
    from torch.distributed.tensor import DTensor, Shard

    cfg.check_world_size(mesh.size())
    gen = torch.Generator().manual_seed(seed + mesh.get_local_rank())
    with torch.device("meta"):
        model = Llama(cfg)
    placements = {
        name: Shard(0) if type(style).__name__ == "ColwiseParallel" else Shard(1)
        for name, style in tp_plan().items()
    }
    n = mesh.size()
    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        rows, cols = (p.shape[0], p.shape[1]) if p.dim() == 2 else (p.shape[0], 1)
        sub = owner.split(".", 2)[-1] if owner.startswith("layers.") else owner
        place = placements.get(sub)
        if place is None:  # replicated: the same values on every rank
            full = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
            if name.endswith("norm.weight"):
                full = 1.0 + 0.1 * full
            value = full.to(device, dtype)
        else:
            local_shape = (rows // n, cols) if place == Shard(0) else (rows, cols // n)
            local = (torch.randn(local_shape, generator=gen) / math.sqrt(cols)).to(device, dtype)
            value = DTensor.from_local(
                local, mesh, [place], run_check=False, shape=p.shape, stride=(cols, 1)
            )
        setattr(model.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=False))
    cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq, cfg.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return tensor_parallel(model, mesh)

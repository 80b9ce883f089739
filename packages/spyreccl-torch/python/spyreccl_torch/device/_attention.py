"""Tensor-parallel attention on spyre: a plain attention mask next to DTensor q/k/v.

Spyre runs ``F.scaled_dot_product_attention`` through
``aten::_scaled_dot_product_efficient_attention`` (src/device/attention.cc), for which
DTensor has sharding rules (heads or batch sharded). One gap remains: SDPA turns a user's
``attn_mask`` into the op's ``attn_bias`` with plain tensor ops, so with DTensor q/k/v the
op receives a plain bias and DTensor refuses the mix. The mask is a regular (non-DTensor)
tensor of an SPMD program, i.e. the same on every rank -- the premise of DTensor's own
``implicit_replication()`` -- so for spyre meshes the bias is wrapped as a replicated
DTensor and the op takes DTensor's normal path (which slices the bias to each rank's heads
locally, without communication).

DTensor is not imported by ``import torch``, and importing it costs ~0.5 s, so the handlers
are installed when something else imports ``torch.distributed.tensor``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._import_hooks import after_import

__all__ = ["install"]

_DTENSOR_MODULE = "torch.distributed.tensor"
_lock = threading.RLock()


def _replicated(bias: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = like.device_mesh
    spec = DTensorSpec(
        mesh,
        (Replicate(),) * mesh.ndim,
        tensor_meta=TensorMeta(shape=bias.shape, stride=bias.stride(), dtype=bias.dtype),
    )
    return DTensor(bias, spec, requires_grad=bias.requires_grad)


def _bias_replicating_handler(query_index: int, bias_index: int) -> Callable[..., object]:
    def handler(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
        from torch.distributed.tensor import DTensor

        query, bias = args[query_index], args[bias_index]
        if (
            isinstance(query, DTensor)
            and query.device_mesh.device_type == "spyre"
            and isinstance(bias, torch.Tensor)
            and not isinstance(bias, DTensor)
        ):
            args = (*args[:bias_index], _replicated(bias, query), *args[bias_index + 1 :])
        # Run the op through DTensor's ordinary dispatch: without this handler for the
        # duration of the call (the lock keeps other threads from seeing it missing).
        handlers = DTensor._op_dispatcher._custom_op_handlers
        with _lock:
            me = handlers.pop(op_call)
            try:
                return op_call(*args, **kwargs)
            finally:
                handlers[op_call] = me

    return handler


def _register_handlers() -> None:
    from torch.distributed.tensor import DTensor

    aten = torch.ops.aten
    handlers = DTensor._op_dispatcher._custom_op_handlers
    # (op, index of query, index of attn_bias) in the op's arguments
    for op, query_index, bias_index in (
        (aten._scaled_dot_product_efficient_attention.default, 0, 3),
        (aten._scaled_dot_product_efficient_attention_backward.default, 1, 4),
    ):
        handlers.setdefault(op, _bias_replicating_handler(query_index, bias_index))


def _efficient_attention_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> Any:
    """Inductor decomposition of spyre's efficient attention without dropout.

    The op carries the ``nondeterministic_seeded`` tag (it can drop out), so inside a
    compiled activation-checkpointed region AOTAutograd wraps it in RNG-state operators
    that inductor implements for CUDA only. Without dropout it is deterministic: the same
    computation as src/device/attention.cc in plain ops, which inductor also fuses. The
    outputs keep the op's meta layout (output over (B, L, H, E) memory, float32
    log-sum-exp padded to 32 queries, 0-d seed and offset).
    """
    if query.device.type != "spyre" or dropout_p != 0.0:
        return NotImplemented
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    b, h, length, _ = query.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(length, key.shape[2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias.to(acc)
    lse = torch.logsumexp(scores, -1)
    finite_lse = lse.masked_fill(lse == float("-inf"), 0.0)  # all-masked rows give zeros
    probs = torch.exp(scores - finite_lse.unsqueeze(-1))
    out = (probs @ value.to(acc)).to(query.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    if compute_log_sumexp:
        padded = (length + 31) // 32 * 32
        saved = torch.nn.functional.pad(lse.float(), (0, padded - length), value=float("inf"))
    else:
        saved = lse.new_empty((b, h, 0), dtype=torch.float32)
    zero = torch.zeros((), dtype=torch.int64, device=query.device)
    return out, saved, zero, zero.clone()


def _register_decomposition() -> None:
    from torch._inductor.decomposition import register_decomposition

    register_decomposition(torch.ops.aten._scaled_dot_product_efficient_attention.default)(
        _efficient_attention_math
    )


def install() -> None:
    """Installs the DTensor handlers and the inductor decomposition, now for the modules
    already loaded, else when they load."""
    after_import(_DTENSOR_MODULE, _register_handlers, "tensor-parallel attention with a mask")
    # After lowering.py, which asserts that no decomposition exists for the ops it
    # registers fallbacks for (this one is spyre-only and declines other devices).
    after_import(
        "torch._inductor.lowering",
        _register_decomposition,
        "compiled, activation-checkpointed attention on spyre",
    )

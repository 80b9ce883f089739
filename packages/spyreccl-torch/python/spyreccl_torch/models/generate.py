"""Greedy generation with the static KV cache of :mod:`spyreccl_torch.models.llama`, and the
token-for-token check against a reference.

A batch of prompts of different lengths is left-padded to the longest: the prefill writes
cache slots ``0..P-1`` (a padded row's pad slots are masked out for every later query), and
decode step ``t`` writes slot ``P + t`` for every row, each row at its own rotary position.
Everything a step needs besides the previous token (positions, mask, slot) is made before the
timed loop, so a step's time is the model's forward and the argmax.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .llama import KVCache, Llama

__all__ = ["Generation", "TokenCheck", "compare_tokens", "generate", "make_prompts"]


def make_prompts(vocab: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class Generation:
    tokens: torch.Tensor  # (batch, new_tokens) int64 on CPU: the prefill's token, then decode's
    ttft_s: float  # prefill + first argmax
    step_s: list[float]  # one wall time per decode step
    margins: torch.Tensor | None = None  # (batch, new_tokens): top-1 minus top-2 logit


@dataclass
class _Plan:
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _plan(prompts: Sequence[Sequence[int]], new_tokens: int, max_seq: int, device) -> _Plan:
    lengths = torch.tensor([len(p) for p in prompts])
    if lengths.min() < 1:
        raise ValueError("generate: every prompt needs at least one token")
    width = int(lengths.max())
    if width + new_tokens - 1 > max_seq:
        raise ValueError(
            f"generate: longest prompt ({width}) + new_tokens ({new_tokens}) - 1 exceeds "
            f"the model's max_seq ({max_seq})"
        )
    batch = len(prompts)
    pads = width - lengths
    tokens = torch.zeros(batch, width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, int(pads[i]) :] = torch.tensor(p)
    cols = torch.arange(max_seq)
    valid = cols[None, :] >= pads[:, None]  # (batch, max_seq): not a pad slot
    rows = torch.arange(width)
    # A pad query sees itself only (an all-masked row would make attention NaN); real
    # queries see the real keys up to their own slot.
    prefill_mask = (cols[None, None, :] <= rows[None, :, None]) & (
        valid[:, None, :] | (cols[None, None, :] == rows[None, :, None])
    )
    plan = _Plan(
        tokens=tokens.to(device),
        positions=(rows[None, :] - pads[:, None]).clamp(min=0).to(device),
        mask=prefill_mask[:, None].to(device),
        slots=rows.to(device),
    )
    for t in range(new_tokens - 1):
        slot = width + t
        plan.steps.append(
            (
                (slot - pads)[:, None].to(device),
                (valid & (cols[None, :] <= slot))[:, None, None, :].to(device),
                torch.tensor([slot], device=device),
            )
        )
    return plan


def _no_sync() -> None:
    return None


@torch.no_grad()
def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    step: Callable[..., torch.Tensor] | None = None,
    synchronize: Callable[[], None] = _no_sync,
    margins: bool = False,
    on_step: Callable[[], None] | None = None,
) -> Generation:
    """Prefill ``prompts`` with ``model`` then decode ``new_tokens - 1`` more tokens greedily
    with ``step`` (``model`` itself, or its ``torch.compile``d form). ``synchronize`` waits for
    the device around every timed interval. ``margins`` also records each step's top-1 minus
    top-2 logit (for the reference: how close a tie would be)."""
    step = model if step is None else step
    plan = _plan(prompts, new_tokens, model.config.max_seq, device)
    cache = KVCache.for_model(model, len(prompts), device, dtype)
    out, gaps = [], []

    def pick(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1].float()
        if margins:
            top = last.topk(2, dim=-1).values
            gaps.append((top[:, 0] - top[:, 1]).double().cpu())
        return last.argmax(-1, keepdim=True)

    synchronize()
    start = time.perf_counter()
    token = pick(model(plan.tokens, plan.positions, plan.mask, plan.slots, cache))
    synchronize()
    ttft = time.perf_counter() - start
    out.append(token)
    times = []
    for positions, mask, slots in plan.steps:
        start = time.perf_counter()
        token = pick(step(token, positions, mask, slots, cache))
        synchronize()
        times.append(time.perf_counter() - start)
        out.append(token)
        if on_step is not None:
            on_step()
    return Generation(
        tokens=torch.cat(out, dim=1).cpu(),
        ttft_s=ttft,
        step_s=times,
        margins=torch.stack(gaps, dim=1) if margins else None,
    )


@dataclass
class TokenCheck:
    ok: bool
    compared: int  # tokens compared (all of them unless a near tie ended a row's comparison)
    total: int
    message: str


def compare_tokens(got: torch.Tensor, reference: Generation, tie_tolerance: float) -> TokenCheck:
    """``got`` must equal the reference's tokens, row by row, token for token. One exception:
    where the reference's top two logits were within ``tie_tolerance`` (a near tie that
    rounding may break either way), a different token is accepted and the rest of that row,
    which then continues from another token, is not compared."""
    ref = reference.tokens
    if got.shape != ref.shape:
        return TokenCheck(False, 0, ref.numel(), f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
    compared, ties, wrong = 0, [], []
    for row in range(ref.shape[0]):
        diff = (got[row] != ref[row]).nonzero()
        if diff.numel() == 0:
            compared += ref.shape[1]
            continue
        at = int(diff[0])
        compared += at
        margin = float(reference.margins[row, at]) if reference.margins is not None else None
        if margin is not None and margin <= tie_tolerance:
            ties.append(f"row {row} step {at} (margin {margin:.2e})")
        else:
            wrong.append(
                f"row {row} step {at}: {int(got[row, at])} vs {int(ref[row, at])}"
                + (f" (reference margin {margin:.2e})" if margin is not None else "")
            )
    total = ref.numel()
    if wrong:
        return TokenCheck(False, compared, total, "differs at " + "; ".join(wrong))
    text = f"{compared}/{total} tokens equal"
    if ties:
        text += "; near ties end the comparison at " + ", ".join(ties)
    return TokenCheck(True, compared, total, text)

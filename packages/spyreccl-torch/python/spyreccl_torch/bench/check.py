"""Result check run once per case before timing (nccl-tests' "#wrong" column, as an error).

A benchmark that does not look at its outputs can report the speed of a broken fast path.
So before the warm-up of every case each rank fills its input with rank-dependent values,
poisons its output, performs the operation once and compares the output with the values
the other ranks must have produced. All values are small integers (at most nranks**2 + 1),
exact in every benchmarked dtype, int8 and bfloat16 included, for up to 11 ranks.

Importable without torch and numpy (the torch-free core rank processes load it by path).
"""

from __future__ import annotations

__all__ = ["POISON", "expected_blocks", "input_blocks", "result_is_send"]

# Written into the output before the checked call; no correct result equals it.
POISON = 123


def input_blocks(op: str, rank: int, nranks: int) -> list[int]:
    """Values of the input buffer, one per block (nranks blocks for all_to_all, else one)."""
    if op == "all_to_all_single":
        return [rank * nranks + p + 1 for p in range(nranks)]
    return [rank + 1]


def expected_blocks(op: str, rank: int, nranks: int) -> list[int] | None:
    """Values the result buffer must hold, one per block; None when there is nothing to check.

    Blocks: nranks for all_gather_into_tensor and all_to_all_single, one otherwise.
    Broadcast's root is rank 0; sendrecv is the ping-pong of ranks 0 and 1.
    """
    total = nranks * (nranks + 1) // 2
    if op in ("all_reduce", "all_reduce_inplace", "reduce_scatter_tensor"):
        return [total]
    if op == "all_gather_into_tensor":
        return [r + 1 for r in range(nranks)]
    if op == "broadcast":
        return [1]
    if op == "all_to_all_single":
        return [q * nranks + rank + 1 for q in range(nranks)]
    if op == "sendrecv":
        return {0: [2], 1: [1]}.get(rank)
    return None  # barrier


def result_is_send(op: str, level: str) -> bool:
    """True when the operation writes its result into the input buffer (in place)."""
    return op in ("broadcast", "all_reduce_inplace") or (
        op == "all_reduce" and not level.startswith("core")
    )

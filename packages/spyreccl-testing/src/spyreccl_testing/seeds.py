"""Fresh, reproducible seeds (torch-free).

Every test draws *fresh* inputs (a seed from os.urandom) so that repeated CI runs explore new
values, and reports the seed on failure so that the failure can be replayed exactly: set
SPYRECCL_TEST_SEED to the printed value to pin every fresh seed.
"""

from __future__ import annotations

import os

SEED_ENV = "SPYRECCL_TEST_SEED"


def fresh_seed() -> int:
    """A new 63-bit seed from os.urandom, or SPYRECCL_TEST_SEED when set (to replay a failure)."""
    pinned = os.environ.get(SEED_ENV)
    if pinned:
        try:
            return int(pinned, 0)
        except ValueError:
            raise ValueError(
                f"{SEED_ENV}={pinned!r} is not an integer; expected the seed printed by a failure"
            ) from None
    return int.from_bytes(os.urandom(8), "little") >> 1


def rank_seed(seed: int, rank: int) -> int:
    """Derives the seed rank `rank` uses from a test's base seed (distinct, reproducible)."""
    if rank < 0:
        raise ValueError(f"rank_seed: rank must be >= 0, got {rank}")
    # A large odd multiplier spreads consecutive ranks over the 63-bit space so that rank r of
    # seed s never collides with rank r+1 of seed s-1.
    return (seed + (rank + 1) * 0x9E3779B97F4A7C15) % (1 << 63)

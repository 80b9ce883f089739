"""The chunk plan of the multi-node layer's overlapped sharded stages (multinode/pipeline.py),
without ranks: the data through chunked groups is checked by pipeline_check in the 2 x 2 job
(test_multinode.py)."""

from __future__ import annotations

import datetime
import itertools
import threading
import time

import pytest
import torch.distributed as dist

from spyreccl_torch.multinode import pipeline

MIB = 1 << 20


@pytest.mark.parametrize(
    ("numel", "granule", "element_size", "chunk_bytes"),
    [
        (4 * MIB // 4, 2, 4, 2 * MIB),
        (16 * MIB // 4, 2, 4, 2 * MIB),
        (64 * MIB // 4, 4, 4, 2 * MIB),
        (40_002, 2, 1, 16 * 1024),
        (40_002, 2, 8, 16 * 1024),
        (20_002, 1, 8, 16 * 1024),
        (3 * 5 * 7 * 11, 3, 4, 64),
        (1 << 30, 8, 4, 2 * MIB),
    ],
)
def test_chunks_cover_the_buffer_on_granule_boundaries(numel, granule, element_size, chunk_bytes):
    bounds = pipeline.chunk_bounds(numel, granule, element_size, chunk_bytes)
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert bounds[0] == 0 and bounds[-1] == numel
    assert all(b % granule == 0 for b in bounds), bounds[:5]
    assert 2 <= len(sizes) <= pipeline.MAX_CHUNKS
    # Every chunk holds at least the target, and they differ by at most one granule.
    assert min(sizes) * element_size >= chunk_bytes or len(sizes) == pipeline.MAX_CHUNKS
    assert max(sizes) - min(sizes) <= granule


def test_chunk_count_follows_the_target():
    # 4 MiB of float32 in 2 MiB chunks: 2; 16 MiB: 8; 64 MiB: capped at 16 (4 MiB each).
    assert len(pipeline.chunk_bounds(MIB, 2, 4, 2 * MIB)) - 1 == 2
    assert len(pipeline.chunk_bounds(4 * MIB, 2, 4, 2 * MIB)) - 1 == 8
    assert len(pipeline.chunk_bounds(16 * MIB, 2, 4, 2 * MIB)) - 1 == 16


@pytest.mark.parametrize(
    ("numel", "granule", "element_size", "chunk_bytes"),
    [
        (0, 2, 4, 2 * MIB),  # empty
        (MIB // 4, 2, 4, 2 * MIB),  # 1 MiB: less than two chunks
        ((4 * MIB - 4) // 4, 2, 4, 2 * MIB),  # just under two chunks
        (4 * MIB // 4, 2, 4, 0),  # off
        (3, 3, 4, 4),  # a single granule
    ],
)
def test_one_chunk_when_off_or_too_small(numel, granule, element_size, chunk_bytes):
    assert pipeline.chunk_bounds(numel, granule, element_size, chunk_bytes) == [0, numel]


def test_no_more_chunks_than_granules():
    # 24 bytes would make 6 chunks of 4, but 6 elements in granules of 3 make only 2.
    assert pipeline.chunk_bounds(6, 3, 4, 4) == [0, 3, 6]


def test_proposal_from_the_variable(monkeypatch):
    monkeypatch.setenv(pipeline.CHUNK_BYTES_ENV, "65536")
    assert pipeline.proposed_chunk_bytes(2) == 65536
    monkeypatch.setenv(pipeline.CHUNK_BYTES_ENV, "0")
    assert pipeline.proposed_chunk_bytes(2) == 0
    for bad in ("-1", "2M", "lots"):
        monkeypatch.setenv(pipeline.CHUNK_BYTES_ENV, bad)
        with pytest.raises(ValueError, match=f"{pipeline.CHUNK_BYTES_ENV}=.*bytes >= 0"):
            pipeline.proposed_chunk_bytes(2)


def test_default_proposal_needs_two_cpus_per_rank_of_the_node(monkeypatch):
    monkeypatch.delenv(pipeline.CHUNK_BYTES_ENV, raising=False)
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert pipeline.proposed_chunk_bytes(8) == pipeline.DEFAULT_CHUNK_BYTES
    assert pipeline.proposed_chunk_bytes(9) == 0
    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: {0, 1})
    assert pipeline.proposed_chunk_bytes(2) == 0  # 4 ranks on a 2-vCPU machine
    assert pipeline.proposed_chunk_bytes(1) == pipeline.DEFAULT_CHUNK_BYTES


def test_the_group_agrees_on_the_smallest_proposal():
    store = dist.HashStore()
    proposals = [2 * MIB, 65536, 2 * MIB]
    agreed: list[int] = [-1] * len(proposals)
    timeout = datetime.timedelta(seconds=10)

    def rank(r: int) -> None:
        agreed[r] = pipeline.agree_chunk_bytes(
            store, r, len(proposals), lambda: proposals[r], timeout
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(proposals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert agreed == [65536] * 3


def test_agreement_waits_within_the_timeout_for_a_missing_rank():
    store = dist.HashStore()
    with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
        pipeline.agree_chunk_bytes(store, 0, 2, lambda: 4096, datetime.timedelta(milliseconds=200))


def test_a_malformed_proposal_fails_every_rank_at_once(monkeypatch):
    # Rank 1's variable is malformed: it raises, and rank 0 raises too, naming rank 1,
    # without waiting for its timeout (60 s here).
    monkeypatch.setenv(pipeline.CHUNK_BYTES_ENV, "2M")
    store = dist.HashStore()
    errors: list[BaseException | None] = [None, None]
    timeout = datetime.timedelta(seconds=60)

    def rank(r: int, propose) -> None:
        try:
            pipeline.agree_chunk_bytes(store, r, 2, propose, timeout)
        except ValueError as error:
            errors[r] = error

    bad = threading.Thread(target=rank, args=(1, lambda: pipeline.proposed_chunk_bytes(2)))
    good = threading.Thread(target=rank, args=(0, lambda: 65536))
    start = time.monotonic()
    for t in (bad, good):
        t.start()
    for t in (bad, good):
        t.join(30)
    assert time.monotonic() - start < 10
    assert "SPYRECCL_MULTINODE_PIPELINE_CHUNK_BYTES='2M'" in str(errors[1])
    assert "rank 1 of the new group" in str(errors[0])
    assert "SPYRECCL_MULTINODE_PIPELINE_CHUNK_BYTES='2M'" in str(errors[0])

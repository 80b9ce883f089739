"""Tensor-parallel greedy generation (the main job's serving half, spyreccl-bench's decode
mode): the Llama-style model of ``spyreccl_torch.models`` sharded with DTensor on 2 and 3
ranks, eager and with compiled blocks, must generate the tokens of a single-process CPU
reference, token for token, for a batch of prompts of different lengths.

Every rank holds an odd number of query heads (3) and one key/value head, so grouped-query
attention and the column shards of q/k/v are exercised with uneven head groups. The reference
is independent of the tensor-parallel path: one process, CPU, float32, and its KV-cache
decoding is itself checked against recomputing the whole sequence without a cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spyreccl_testing.inputs import fresh_seed
from spyreccl_torch.models.generate import Generation, compare_tokens, generate, make_prompts
from spyreccl_torch.models.llama import (
    Llama,
    LlamaConfig,
    compile_blocks,
    local_shard_model,
    manual_tensor_parallel,
    rehome_tensor_parallel,
    tensor_parallel,
)

pytestmark = pytest.mark.world_sizes(2, 3)

HEAD_DIM, NEW_TOKENS = 16, 10
PROMPT_LENGTHS = [5, 11, 2, 8]
# float32 through 2 layers: a tensor-parallel logit differs from the reference's by ~1e-6;
# only a reference margin below this may break a tie the other way.
TIE_TOLERANCE = 1e-4


def _config(world_size: int) -> LlamaConfig:
    heads, kv = 3 * world_size, world_size  # 3 query heads, 1 kv head per rank
    return LlamaConfig(
        vocab=257, dim=heads * HEAD_DIM, n_layers=2, n_heads=heads, n_kv_heads=kv,
        hidden=64 * world_size, max_seq=max(PROMPT_LENGTHS) + NEW_TOKENS,
    )  # fmt: skip


def _reference(cfg: LlamaConfig, seed: int) -> tuple[list[list[int]], Generation]:
    prompts = make_prompts(cfg.vocab, PROMPT_LENGTHS, seed)
    model = Llama.from_seed(cfg, seed)
    return prompts, generate(
        model, prompts, NEW_TOKENS, device="cpu", dtype=torch.float32, margins=True
    )


def _tp_generate_case(seed: int, form: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    ws = dist.get_world_size()
    cfg = _config(ws)
    prompts, reference = _reference(cfg, seed)
    mesh = init_device_mesh("spyre", (ws,))
    device = torch.device("spyre", torch.accelerator.current_device_index())
    tp = tensor_parallel(Llama.from_seed(cfg, seed).to(device), mesh)
    wq = tp.layers[0].attention.wq.weight
    assert isinstance(wq, DTensor) and wq.placements == (Shard(0),)
    assert wq.to_local().shape[0] == 3 * HEAD_DIM  # 3 query heads on this rank
    assert tp.layers[0].attention.wk.weight.to_local().shape[0] == HEAD_DIM
    step = compile_blocks(tp, dynamic=False) if form == "compiled" else tp
    codes: list[str] = []
    if form == "compiled":
        from torch._inductor.utils import run_and_get_code

        got, codes = run_and_get_code(
            generate, tp, prompts, NEW_TOKENS, device=device, dtype=torch.float32, step=step,
            synchronize=torch.spyre.synchronize,
        )  # fmt: skip
        # One graph serves every block, and each of its two all_reduces is waited at once:
        # bound as `..._then_wait`, it runs inline up to SPYRECCL_INLINE_MAX_BYTES (4 MiB),
        # so decode-sized all_reduces (batch x width) never pay the progress-thread hand-off.
        assert len(codes) == 1, f"{len(codes)} graphs compiled for {cfg.n_layers} blocks"
        calls = [
            line.strip()
            for line in codes[0].splitlines()
            if line.strip().startswith("_spyreccl_all_reduce") and "=" not in line.split("(")[0]
        ]
        assert len(calls) == 2 and all("_then_wait(" in c for c in calls), calls
    else:
        got = generate(
            tp, prompts, NEW_TOKENS, device=device, dtype=torch.float32, step=step,
            synchronize=torch.spyre.synchronize,
        )  # fmt: skip
    check = compare_tokens(got.tokens, reference, TIE_TOLERANCE)
    assert check.ok, f"{form}, {ws} ranks: {check.message}"
    if form == "eager":
        # The same shards with the same all_reduces issued by hooks, without DTensor (the
        # decode benchmark's measure of DTensor's eager dispatch): the same tokens.
        manual = generate(manual_tensor_parallel(tp, dist.group.WORLD.group_name), prompts,
                          NEW_TOKENS, device=device, dtype=torch.float32)  # fmt: skip
        manual_check = compare_tokens(manual.tokens, reference, TIE_TOLERANCE)
        assert manual_check.ok, f"manual tensor parallel, {ws} ranks: {manual_check.message}"
    # The compute floor runs the same shards without collectives: its row-parallel outputs
    # are partial sums, so (unlike the tensor-parallel model) it must not reproduce them.
    floor = generate(local_shard_model(tp), prompts, NEW_TOKENS, device=device,
                     dtype=torch.float32, margins=True)  # fmt: skip

    def stepper(model: Llama):
        return compile_blocks(model, dynamic=False) if form == "compiled" else model

    # The same DTensor model moved to another mesh of the same group: the same tokens.
    rehomed = rehome_tensor_parallel(tp, init_device_mesh("spyre", (ws,)))
    moved = generate(rehomed, prompts, NEW_TOKENS, device=device, dtype=torch.float32,
                     step=stepper(rehomed))  # fmt: skip
    rehomed_check = compare_tokens(moved.tokens, reference, TIE_TOLERANCE)
    assert rehomed_check.ok, f"rehomed, {form}, {ws} ranks: {rehomed_check.message}"
    # On a mesh whose group moves nothing (the decode benchmark's DTensor floor), every
    # all_reduce leaves this rank's partial sum, eager and compiled: the floor's numbers.
    from spyreccl_torch.bench.decode_timing import transferless_mesh

    dt_floor = rehome_tensor_parallel(tp, transferless_mesh("spyre", ws))
    skipped = generate(dt_floor, prompts, NEW_TOKENS, device=device, dtype=torch.float32,
                       step=stepper(dt_floor))  # fmt: skip
    dt_floor_check = compare_tokens(skipped.tokens, floor, TIE_TOLERANCE)
    assert dt_floor_check.ok, f"DTensor floor, {form}, {ws} ranks: {dt_floor_check.message}"
    return {
        "tokens": got.tokens,
        "compared": check.compared,
        "total": check.total,
        "floor_equal": bool(torch.equal(floor.tokens, reference.tokens)),
    }


@pytest.mark.parametrize("form", ["eager", "compiled"])
def test_tensor_parallel_generate_matches_single_process_reference(rank_pool, form):
    seed = fresh_seed()
    results = rank_pool.run(_tp_generate_case, seed, form, timeout=600)
    _, reference = _reference(_config(rank_pool.world_size), seed)
    for rank, r in enumerate(results):
        # Every rank generated the same tokens (the output layer is replicated).
        assert torch.equal(r["tokens"], results[0]["tokens"]), f"rank {rank} differs"
        assert r["total"] == len(PROMPT_LENGTHS) * NEW_TOKENS
        # Near ties may end a row's comparison early, but never most of the run.
        assert r["compared"] >= r["total"] // 2, r
        assert not r["floor_equal"]
    assert results[0]["tokens"].shape == reference.tokens.shape


def test_kv_cache_decoding_equals_recomputing_without_cache():
    cfg = LlamaConfig(vocab=101, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq=24)
    seed = fresh_seed()
    model = Llama.from_seed(cfg, seed)
    prompts = make_prompts(cfg.vocab, [3, 9, 1], seed)
    got = generate(model, prompts, 8, device="cpu", dtype=torch.float32, margins=True)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            seq = list(prompt)
            for _ in range(8):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            check = compare_tokens(
                torch.tensor([seq[len(prompt) :]]),
                Generation(got.tokens[row : row + 1], 0.0, [], got.margins[row : row + 1]),
                TIE_TOLERANCE,
            )
            assert check.ok, f"prompt {row}: {check.message}"


def test_compare_tokens_rejects_a_wrong_token_and_accepts_only_near_ties():
    tokens = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    margins = torch.tensor([[1.0, 1.0, 1e-6, 1.0], [1.0, 0.5, 1.0, 1.0]], dtype=torch.float64)
    ref = Generation(tokens, 0.0, [], margins)
    assert compare_tokens(tokens.clone(), ref, 1e-4).ok
    wrong = tokens.clone()
    wrong[1, 1] = 9  # margin 0.5: a real difference
    check = compare_tokens(wrong, ref, 1e-4)
    assert not check.ok and "row 1 step 1: 9 vs 2" in check.message
    tie = tokens.clone()
    tie[0, 2:] = torch.tensor([0, 0])  # margin 1e-6 at step 2: a near tie, rest not compared
    check = compare_tokens(tie, ref, 1e-4)
    assert check.ok and check.compared == 6 and "near ties" in check.message
    assert not compare_tokens(tokens[:, :3], ref, 1e-4).ok  # wrong shape

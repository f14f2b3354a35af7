"""QUEST decode policy: the key min/max bound, the scoring kernel against its reference (under
Triton's interpreter here, bfloat16 on the GPU in tests/gpu/test_quest_gpu.py), block selection,
its metadata across tiers, and tensor parallelism (equality with FULL when every block is picked,
and the reuse cache: tests/test_tiers.py, tests/test_reuse.py)."""
import pytest
import torch

from _interpreter import interpreted_only, run_interpreted_tests
from _util import build_llm, greedy, random_prompt
from nanovllm.sparse.quest import QUEST_PAGE_SIZE, QuestPolicy
from nanovllm.ops.quest_scores import (block_scores, quest_bounds, quest_bounds_ref, quest_head_bounds,
                                          select_top_blocks, top_blocks, top_blocks_ref)


def test_bounds_bound_every_key_of_the_block_per_head():
    torch.manual_seed(0)
    keys = torch.randn(2, 6, 3, 16, 2, 8)  # [seqs, blocks, pages, tokens, Hkv, D]
    q = torch.randn(2, 4, 8)  # Hq = 4, GQA 2:1
    bounds = quest_head_bounds(q, keys.amin(3), keys.amax(3))
    assert bounds.shape == (2, 6, 4)
    for s in range(2):
        for h in range(4):
            assert torch.all(bounds[s, :, h] >= (keys[s, :, :, :, h // 2] @ q[s, h]).flatten(1).amax(1) - 1e-5)
    one_key = keys[:, :, :1, :1]  # one page of one token: the bound is exact
    exact = torch.stack([torch.stack([(one_key[s, :, 0, 0, h // 2] @ q[s, h]) for h in range(4)], 1)
                         for s in range(2)])
    torch.testing.assert_close(quest_head_bounds(q, one_key.amin(3), one_key.amax(3)), exact)


def test_block_scores_sum_each_heads_shares():
    """Each head's bounds become a softmax over the candidate blocks, summed over heads: a head
    with a sharp favourite outvotes one whose bounds are large but flat (the largest bound over
    heads would pick the flat head's block); rows without candidates stay -inf."""
    inf = float("-inf")
    flat, sharp = [50.0, 50.5, 50.0, inf], [0.0, 0.0, 20.0, inf]
    bounds = torch.tensor([[flat, sharp], [[inf] * 4, [inf] * 4]]).transpose(1, 2)  # [S=2, M=4, Hq=2]
    scores = block_scores(bounds, 1.0)
    assert bounds.amax(2)[0].argmax().item() == 1, "max over heads: the flat head's best block"
    assert scores[0].argmax().item() == 2
    shares = torch.softmax(bounds[0], 0)
    torch.testing.assert_close(scores[0, :3], shares.sum(1)[:3])
    assert torch.isneginf(scores[0, 3]) and torch.isneginf(scores[1]).all()
    assert select_top_blocks(scores, 1).tolist() == [[2], [-1]]


def _bounds(num_slots, pages, heads_kv, dim, dtype=torch.float32, seed=0):
    keys = torch.randn(num_slots, pages, QUEST_PAGE_SIZE, heads_kv, dim, generator=torch.Generator().manual_seed(seed))
    return keys.amin(2).to(dtype), keys.amax(2).to(dtype)


SLOTS = torch.tensor([[0, 3, -1, 6], [5, -1, -1, 2], [-1, -1, -1, -1]])


def test_bounds_of_slots_are_the_bounds_of_the_gathered_pages():
    kmin, kmax = _bounds(7, 5, 2, 8)
    q = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(1))
    bounds = quest_bounds(q, kmin, kmax, SLOTS)
    assert bounds.shape == (3, 4, 6)
    assert torch.equal(bounds, quest_bounds_ref(q, kmin, kmax, SLOTS)), "CPU dispatches to the reference"
    for s, row in enumerate(SLOTS.tolist()):
        for m, slot in enumerate(row):
            want = torch.full((6,), float("-inf")) if slot < 0 else quest_head_bounds(
                q[s:s + 1], kmin[slot][None, None], kmax[slot][None, None])[0, 0]
            torch.testing.assert_close(bounds[s, m], want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="slots must be int64"):
        quest_bounds(q, kmin, kmax, SLOTS.int())
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        quest_bounds(q[:, :5], kmin, kmax, SLOTS)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_quest_bounds_kernel_equals_reference(dtype):
    """Pages not a multiple of the kernel's tile (80 of 64), GQA 3:1 padded to 16 rows, head_dim
    24 padded to 32, rows without candidates."""
    kmin, kmax = _bounds(7, 80, 2, 24, dtype)
    q = torch.randn(3, 6, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, want = quest_bounds(q, kmin, kmax, SLOTS), quest_bounds_ref(q, kmin, kmax, SLOTS)
    assert torch.equal(torch.isinf(got), (SLOTS < 0)[..., None].expand_as(got))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def random_bounds(seed: int, seqs: int, blocks: int, heads: int) -> torch.Tensor:
    """float32 ``[S, M, Hq]`` bounds, about a third of the blocks not candidates (-inf for every
    head) and the last sequence without any candidate."""
    gen = torch.Generator().manual_seed(seed)
    bounds = torch.randn(seqs, blocks, heads, generator=gen) * 3
    bounds[torch.rand(seqs, blocks, generator=gen) < 0.3] = float("-inf")
    bounds[-1] = float("-inf")
    return bounds


def assert_same_picks(got: torch.Tensor, bounds: torch.Tensor, scale: float, topk: int):
    """``got`` picks what :func:`top_blocks_ref` picks: the same -1 entries and, best first, the
    same scores (to float rounding, so that a near-tie may pick either block)."""
    want = top_blocks_ref(bounds, scale, topk)
    assert got.shape == want.shape and got.dtype == torch.int64
    assert torch.equal(got < 0, want < 0)
    scores = block_scores(bounds, scale)
    valid = want >= 0
    torch.testing.assert_close(scores.gather(1, got.clamp(min=0))[valid], scores.gather(1, want.clamp(min=0))[valid],
                               rtol=0, atol=1e-5)
    for row in got.tolist():
        picked = [c for c in row if c >= 0]
        assert len(set(picked)) == len(picked)


@interpreted_only
@pytest.mark.parametrize("blocks,heads,topk", [(37, 6, 4), (9, 14, 16), (600, 14, 8)])
def test_interpreted_top_blocks_kernel_equals_reference(blocks, heads, topk):
    """Fewer candidates than top-k (-1 padding), a sequence without candidates, and (600 blocks)
    heads in several tiles."""
    for seed in range(3):
        bounds = random_bounds(seed, 4, blocks, heads)
        assert_same_picks(top_blocks(bounds, 0.125, topk), bounds, 0.125, topk)


def test_top_blocks_checks_its_arguments():
    bounds = random_bounds(0, 2, 5, 4)
    with pytest.raises(ValueError, match="bounds must be float32"):
        top_blocks(bounds.double(), 1.0, 2)
    with pytest.raises(ValueError, match="topk must be >= 1, got 0"):
        top_blocks(bounds, 1.0, 0)


def test_triton_kernel_under_interpreter():
    run_interpreted_tests(__file__, min_passed=5)


def test_selection_takes_the_best_candidates():
    inf = float("-inf")
    scores = torch.tensor([[inf, 5.0, -1.0, 9.0, 3.0, inf], [inf, 1.0, 7.0, inf, inf, inf]])
    assert select_top_blocks(scores, 2).tolist() == [[3, 1], [2, 1]]
    assert select_top_blocks(scores, 3).tolist() == [[3, 1, 4], [2, 1, -1]], "-1: fewer candidates than k"
    assert select_top_blocks(scores, 9).shape == (2, 6)


def test_policy_picks_the_best_middle_blocks_of_both_tiers():
    """Slots from DecodeSelection: blocks 0, n-2 and n-1 are fixed (never candidates), host blocks
    are scored from their host-tier bounds."""
    from nanovllm.kvcache.tier_rows import TierRows
    from nanovllm.kvcache.selection import DecodeSelection

    layers, block, heads, dim, gpu_blocks = 1, 64, 2, 8, 8
    policy = QuestPolicy(dim ** -0.5, topk_blocks=2, threshold_blocks=0)
    policy.allocate(layers, block, heads, dim, torch.float32, torch.device("cpu"), gpu_blocks, 4)
    gen = torch.Generator().manual_seed(3)
    policy.kmin.copy_(torch.randn(policy.kmin.shape, generator=gen))
    policy.kmax.copy_(policy.kmin + torch.rand(policy.kmin.shape, generator=gen))
    tables = [([0, -1, 5, -1, 6, 1, 7], [-1, 2, -1, 0, -1, -1, -1], 6 * block + 3)]
    selection = DecodeSelection.build(policy, tables, TierRows(layers, gpu_blocks, 2), gpu_blocks, block,
                                      torch.device("cpu"))
    assert selection.blocks.slots.tolist() == [[-1, gpu_blocks + 2, 5, gpu_blocks + 0, 6, -1, -1]]
    q = torch.randn(1, 4, dim, generator=gen)
    picks = policy.select_decode_blocks(0, q, selection.blocks)[0].tolist()
    slots = [gpu_blocks + 2, 5, gpu_blocks, 6]
    bounds = torch.cat([quest_head_bounds(q, policy.kmin[0, s][None, None], policy.kmax[0, s][None, None])[0]
                        for s in slots])  # [4 candidates, Hq]
    scores = torch.softmax(bounds * dim ** -0.5, 0).sum(1).tolist()
    best = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert sorted(picks) == sorted(i + 1 for i in best)


def test_bounds_follow_a_block_from_the_gpu_tier_to_the_host_tier():
    policy = QuestPolicy(0.1, topk_blocks=1, threshold_blocks=0)
    layers, block, heads, dim = 2, 64, 2, 8
    policy.allocate(layers, block, heads, dim, torch.float32, torch.device("cpu"), 4, 3)
    k_cache = torch.randn(layers, 4, block, heads, dim)
    policy.on_blocks_full(k_cache, torch.tensor([2, 0]))
    pages = k_cache[:, 2].view(layers, block // QUEST_PAGE_SIZE, QUEST_PAGE_SIZE, heads, dim)
    assert torch.equal(policy.kmin[:, 2], pages.amin(2))
    policy.on_spill(torch.tensor([2]), torch.tensor([1]))
    assert torch.equal(policy.kmax[:, 4 + 1], pages.amax(2)), "host block 1 is metadata slot 4 + 1"
    assert torch.equal(policy.kmin[:, 4 + 1], pages.amin(2))
    assert policy.metadata_bytes_per_block(layers, block, heads, dim, torch.float32) == \
        2 * layers * (block // QUEST_PAGE_SIZE) * heads * dim * 4


def test_quest_tensor_parallel_selects_like_tp1(llama_tied_dir):
    """Each rank scores blocks with its own query heads; the ranks sum the heads' shares
    (all-reduce), so TP=2 selects TP=1's blocks and gives its tokens, in both tiers."""
    prompts = [random_prompt(n, seed=300 + n) for n in (1300, 1500)]
    opts = dict(max_model_len=1536, enable_cpu_offload=True, num_kvcache_blocks=6, num_ring_slots=2,
                num_cpu_kvcache_blocks=16, sparse_policy="QUEST", sparse_topk_blocks=1, sparse_threshold_blocks=2)
    with build_llm(llama_tied_dir, **opts) as tp1:
        ref = [o["token_ids"] for o in tp1.generate(prompts, greedy(30), use_tqdm=False)]
        assert tp1.get_kv_cache_stats()["spilled_blocks"] > 0
    with build_llm(llama_tied_dir, tensor_parallel_size=2, **opts) as tp2:
        out = [o["token_ids"] for o in tp2.generate(prompts, greedy(30), use_tqdm=False)]
    assert out == ref

"""QUEST decode policy: the key min/max bound, the scoring kernel against its reference (under
Triton's interpreter here, bfloat16 on the GPU in tests/gpu/test_quest_gpu.py), block selection,
its metadata across tiers, and tensor parallelism (equality with FULL when every block is picked,
and the reuse cache: tests/test_tiers.py, tests/test_reuse.py)."""
import pytest
import torch

from _interpreter import interpreted_only, run_interpreted_tests
from _util import build_llm, greedy, random_prompt
from nanovllm.sparse.quest import QUEST_PAGE_SIZE, QuestPolicy, select_top_blocks
from nanovllm.sparse.quest_scores import quest_block_scores, quest_scores, quest_scores_ref


def test_scores_bound_every_key_of_the_block():
    torch.manual_seed(0)
    keys = torch.randn(2, 6, 3, 16, 2, 8)  # [seqs, blocks, pages, tokens, Hkv, D]
    q = torch.randn(2, 4, 8)  # Hq = 4, GQA 2:1
    scores = quest_block_scores(q, keys.amin(3), keys.amax(3))
    assert scores.shape == (2, 6)
    for s in range(2):
        per_head = torch.stack([(keys[s, :, :, :, h // 2] @ q[s, h]).flatten(1).amax(1) for h in range(4)], 1)
        assert torch.all(scores[s] >= per_head.amax(1) - 1e-5)
    one_key = keys[:, :, :1, :1]  # one page of one token: the bound is exact
    exact = torch.stack([torch.stack([(one_key[s, :, 0, 0, h // 2] @ q[s, h]) for h in range(4)], 1).amax(1)
                         for s in range(2)])
    torch.testing.assert_close(quest_block_scores(q, one_key.amin(3), one_key.amax(3)), exact)


def _bounds(num_slots, pages, heads_kv, dim, dtype=torch.float32, seed=0):
    keys = torch.randn(num_slots, pages, QUEST_PAGE_SIZE, heads_kv, dim, generator=torch.Generator().manual_seed(seed))
    return keys.amin(2).to(dtype), keys.amax(2).to(dtype)


SLOTS = torch.tensor([[0, 3, -1, 6], [5, -1, -1, 2], [-1, -1, -1, -1]])


def test_scores_of_slots_are_the_scores_of_the_gathered_bounds():
    kmin, kmax = _bounds(7, 5, 2, 8)
    q = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(1))
    scores = quest_scores(q, kmin, kmax, SLOTS)
    assert torch.equal(scores, quest_scores_ref(q, kmin, kmax, SLOTS)), "CPU dispatches to the reference"
    for s, row in enumerate(SLOTS.tolist()):
        for m, slot in enumerate(row):
            want = float("-inf") if slot < 0 else quest_block_scores(q[s:s + 1], kmin[slot][None, None],
                                                                     kmax[slot][None, None])[0, 0].item()
            assert scores[s, m].item() == pytest.approx(want, abs=1e-5), (s, m)
    with pytest.raises(ValueError, match="slots must be int64"):
        quest_scores(q, kmin, kmax, SLOTS.int())
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        quest_scores(q[:, :5], kmin, kmax, SLOTS)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_quest_scores_kernel_equals_reference(dtype):
    """Pages not a multiple of the kernel's tile (80 of 64), GQA 3:1 padded to 16 rows, head_dim
    24 padded to 32, rows without candidates."""
    kmin, kmax = _bounds(7, 80, 2, 24, dtype)
    q = torch.randn(3, 6, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, want = quest_scores(q, kmin, kmax, SLOTS), quest_scores_ref(q, kmin, kmax, SLOTS)
    assert torch.equal(torch.isinf(got), SLOTS < 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_triton_kernel_under_interpreter():
    run_interpreted_tests(__file__, min_passed=2)


def test_selection_takes_the_best_candidates():
    inf = float("-inf")
    scores = torch.tensor([[inf, 5.0, -1.0, 9.0, 3.0, inf], [inf, 1.0, 7.0, inf, inf, inf]])
    assert select_top_blocks(scores, 2).tolist() == [[3, 1], [2, 1]]
    assert select_top_blocks(scores, 3).tolist() == [[3, 1, 4], [2, 1, -1]], "-1: fewer candidates than k"
    assert select_top_blocks(scores, 9).shape == (2, 6)


def test_policy_picks_the_best_middle_blocks_of_both_tiers():
    """Slots from DecodeSelection: blocks 0, n-2 and n-1 are fixed (never candidates), host blocks
    are scored from their host-tier bounds."""
    from nanovllm.kvcache.selection import DecodeSelection

    layers, block, heads, dim, gpu_blocks = 1, 64, 2, 8, 8
    policy = QuestPolicy(dim ** -0.5, topk_blocks=2, threshold_blocks=0)
    policy.allocate(layers, block, heads, dim, torch.float32, torch.device("cpu"), gpu_blocks, 4)
    gen = torch.Generator().manual_seed(3)
    policy.kmin.copy_(torch.randn(policy.kmin.shape, generator=gen))
    policy.kmax.copy_(policy.kmin + torch.rand(policy.kmin.shape, generator=gen))
    tables = [([0, -1, 5, -1, 6, 1, 7], [-1, 2, -1, 0, -1, -1, -1], 6 * block + 3)]
    selection = DecodeSelection.build(policy, tables, gpu_blocks, block, torch.device("cpu"))
    assert selection.blocks.slots.tolist() == [[-1, gpu_blocks + 2, 5, gpu_blocks + 0, 6, -1, -1]]
    q = torch.randn(1, 4, dim, generator=gen)
    picks = policy.select_decode_blocks(0, q, selection.blocks)[0].tolist()
    slots = [gpu_blocks + 2, 5, gpu_blocks, 6]
    scores = [quest_block_scores(q, policy.kmin[0, s][None, None], policy.kmax[0, s][None, None]).item() for s in slots]
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
    """Each rank scores blocks with its own query heads; the ranks take the maximum over all of
    them (all-reduce), so TP=2 selects TP=1's blocks and gives its tokens, in both tiers."""
    prompts = [random_prompt(n, seed=300 + n) for n in (1300, 1500)]
    opts = dict(max_model_len=1536, enable_cpu_offload=True, num_kvcache_blocks=6, num_ring_slots=2,
                num_cpu_kvcache_blocks=16, sparse_policy="QUEST", sparse_topk_blocks=1, sparse_threshold_blocks=2)
    with build_llm(llama_tied_dir, **opts) as tp1:
        ref = [o["token_ids"] for o in tp1.generate(prompts, greedy(30), use_tqdm=False)]
        assert tp1.get_kv_cache_stats()["spilled_blocks"] > 0
    with build_llm(llama_tied_dir, tensor_parallel_size=2, **opts) as tp2:
        out = [o["token_ids"] for o in tp2.generate(prompts, greedy(30), use_tqdm=False)]
    assert out == ref

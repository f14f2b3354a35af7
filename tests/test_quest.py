"""QUEST decode policy: the key min/max bound, block selection, its metadata across tiers, and
tensor parallelism (equality with FULL at top-k >= blocks: tests/test_tiers.py)."""
import torch

from _util import build_llm, greedy, random_prompt
from nanovllm.sparse.quest import QUEST_PAGE_SIZE, QuestPolicy, quest_block_scores, select_top_blocks


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


def test_selection_keeps_first_last_full_and_written_blocks_and_the_best():
    scores = torch.tensor([[0.0, 5.0, -1.0, 9.0, 3.0, -2.0, 8.0], [0.0, 1.0, 7.0, 2.0, 9.0, 9.0, 9.0]])
    # row 0: 7 blocks, 6 full (block 5 the last full one, block 6 being written); row 1: 6 full, all full
    assert select_top_blocks(scores, [7, 6], [6, 6], 2) == [[0, 1, 3, 5, 6], [0, 2, 4, 5]]
    assert select_top_blocks(scores, [7, 6], [6, 6], 1) == [[0, 3, 5, 6], [0, 4, 5]]
    assert select_top_blocks(scores, [7, 6], [6, 6], 4) == [list(range(7)), list(range(6))]


def test_bounds_follow_a_block_from_the_gpu_tier_to_the_host_tier():
    policy = QuestPolicy(0.1, topk_blocks=1, threshold_blocks=0)
    layers, block, heads, dim = 2, 64, 2, 8
    policy.allocate(layers, block, heads, dim, torch.float32, torch.device("cpu"), 4, 3)
    k_cache = torch.randn(layers, 4, block, heads, dim)
    policy.on_blocks_full(k_cache, torch.tensor([2, 0]))
    pages = k_cache[:, 2].view(layers, block // QUEST_PAGE_SIZE, QUEST_PAGE_SIZE, heads, dim)
    assert torch.equal(policy.bounds["gpu"][0][:, 2], pages.amin(2))
    policy.on_spill(torch.tensor([2]), torch.tensor([1]))
    assert torch.equal(policy.bounds["host"][1][:, 1], pages.amax(2))
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

"""QUEST decode policy: the key min/max bound, block selection, and equality with FULL when
every block is selected."""
import torch

from _util import build_llm, greedy, random_prompt
from nanovllm.kvcache.sparse.quest_policy import quest_block_scores, select_top_blocks


def test_scores_bound_every_key_of_the_block():
    torch.manual_seed(0)
    keys = torch.randn(6, 16, 2, 8)  # [blocks, tokens, Hkv, D]
    q = torch.randn(4, 8)  # Hq = 4, GQA 2:1
    scores = quest_block_scores(q, keys.amin(1), keys.amax(1))
    per_head = torch.stack([(keys[:, :, h // 2] @ q[h]).amax(1) for h in range(4)], 1)  # [blocks, Hq]
    assert torch.all(scores >= per_head.amax(1) - 1e-5)
    one_key = keys[:, :1]  # a block of one token: the bound is exact
    exact = torch.stack([(one_key[:, 0, h // 2] @ q[h]) for h in range(4)], 1).amax(1)
    torch.testing.assert_close(quest_block_scores(q, one_key.amin(1), one_key.amax(1)), exact)


def test_selection_keeps_first_and_last_and_the_best():
    scores = torch.tensor([0.0, 5.0, -1.0, 9.0, 3.0, -2.0])
    assert select_top_blocks(scores, 2) == [0, 1, 3, 5]
    assert select_top_blocks(scores, 1) == [0, 3, 5]
    assert select_top_blocks(scores, 4) == list(range(6))


def _run(llm, prompts, max_tokens):
    engine = llm.model_runner.offload_engine
    engine.reset()
    out = [o["token_ids"] for o in llm.generate(prompts, greedy(max_tokens), use_tqdm=False)]
    return out, engine.bytes_h2d


def test_quest_with_all_blocks_equals_full(llama_tied_dir):
    prompts = [random_prompt(n, seed=n) for n in (700, 1300)]
    common = dict(max_model_len=1536, enable_cpu_offload=True, num_gpu_blocks=2, num_cpu_kvcache_blocks=16)
    full = build_llm(llama_tied_dir, **common)
    ref, full_bytes = _run(full, prompts, 40)
    full.shutdown()
    quest = build_llm(llama_tied_dir, sparse_policy="QUEST", sparse_topk_blocks=8, sparse_threshold_blocks=0, **common)
    got, _ = _run(quest, prompts, 40)
    quest.shutdown()
    assert got == ref
    sparse = build_llm(llama_tied_dir, sparse_policy="QUEST", sparse_topk_blocks=1, sparse_threshold_blocks=2, **common)
    out, sparse_bytes = _run(sparse, prompts, 40)
    sparse.shutdown()
    assert all(len(o) == 40 for o in out)
    assert sparse_bytes < full_bytes, "3 of up to 6 blocks must load less than FULL"


def test_quest_tensor_parallel_selects_like_tp1(llama_tied_dir):
    """Each rank scores blocks with its own query heads; the ranks take the maximum over all of
    them (all-reduce), so TP=2 selects TP=1's blocks and gives its tokens."""
    prompts = [random_prompt(n, seed=300 + n) for n in (1300, 1500)]
    opts = dict(max_model_len=1536, enable_cpu_offload=True, num_gpu_blocks=2, num_cpu_kvcache_blocks=16,
                sparse_policy="QUEST", sparse_topk_blocks=1, sparse_threshold_blocks=2)
    with build_llm(llama_tied_dir, **opts) as tp1:
        ref, _ = _run(tp1, prompts, 30)
    with build_llm(llama_tied_dir, tensor_parallel_size=2, **opts) as tp2:
        out = [o["token_ids"] for o in tp2.generate(prompts, greedy(30), use_tqdm=False)]
    assert out == ref

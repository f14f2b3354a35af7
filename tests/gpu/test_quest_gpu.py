"""QUEST on the GPU: the page-bounds kernel against its reference at real shapes (bfloat16
included, which Triton's interpreter cannot check), and the CUDA decode path of a choosing policy
(per-KV-head page tables, host pages gathered in place, the reuse cache, the ring of the rows that
read everything) on a tiny checkpoint in float32: picking every page it equals FULL, and the reuse
cache changes traffic, not tokens. Run on the device:

    python -m pytest tests/gpu/test_quest_gpu.py -q
"""
import pytest
import torch

from _util import build_llm, generate_with_logits, random_prompt
from nanovllm.ops.quest_scores import box_scores, box_scores_ref, page_scores, page_scores_ref, top_pages, top_pages_ref
from nanovllm.sparse.choosing import ChoosingPolicy

pytestmark = pytest.mark.gpu

SHAPES = {"llama-3.1-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}  # Hq, Hkv, D


@pytest.mark.parametrize("weight", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_page_bounds_kernel_equals_reference(shape, dtype, weight):
    """3 sequences over 2,000 candidate pages of 16 tokens (32K tokens) among 4,096 metadata
    pages, with padding: the upper bounds (weight 1) and the one-launch box scores (weight 0.5)."""
    heads_q, heads_kv, dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(4096, 16, heads_kv, dim, device="cuda", generator=gen)
    kmin, kmax = keys.amin(1).to(dtype), keys.amax(1).to(dtype)
    q = torch.randn(3, heads_q, dim, device="cuda", generator=gen).to(dtype)
    pages = torch.randint(0, 4096, (3, 2000), device="cuda", generator=gen)
    pages[2, 1200:] = -1
    got, want = box_scores(q, kmin, kmax, pages, weight), box_scores_ref(q, kmin, kmax, pages, weight)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("combine", ["max", "sum"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_page_scores_kernel_equals_reference(shape, combine):
    """3 sequences over 8,192 candidate pages (128K tokens of 16), one with a third of them
    padding: the one-launch scores against the torch reference."""
    heads_q, heads_kv, _ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(2)
    bounds = torch.randn(3, 8192, heads_q, device="cuda", generator=gen) * 8
    bounds[1, 5000:] = float("-inf")
    got, want = page_scores(bounds, 0.088, heads_kv, combine), page_scores_ref(bounds, 0.088, heads_kv, combine)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("rows, num_cols, k", [(24, 8192, 800), (48, 2048, 200), (8, 65536, 6400), (4, 100, 300)])
def test_top_pages_kernel_equals_topk(rows, num_cols, k):
    """The radix select against ``torch.topk`` at decode shapes (128K and 1M tokens of 16-token
    pages, 64-token pages, fewer candidates than k), with rows padded by -inf; distinct scores
    (which of equal ones at the k-th place are taken is not specified)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    scores = torch.rand(rows // 4, 4, num_cols, device="cuda", generator=gen).argsort(dim=2).float()  # distinct
    scores[0, :, num_cols // 3:] = float("-inf")
    got, want = top_pages(scores, k), top_pages_ref(scores, k)
    assert torch.equal(got.sort(dim=2).values, want.sort(dim=2).values)


def test_cuda_decode_path_of_quest_equals_full_and_reuse_changes_only_traffic(qwen3_dir, monkeypatch):
    prompts = [random_prompt(n, seed=n) for n in (3000, 1000, 2200, 700)]
    opts = dict(max_model_len=3100, device="cuda", dtype="float32", enforce_eager=False, num_kvcache_blocks=8,
                enable_cpu_offload=True, num_cpu_kvcache_blocks=64, num_ring_slots=3)
    with build_llm(qwen3_dir, **opts) as llm:
        ref = generate_with_logits(llm, prompts, 48)
    with monkeypatch.context() as patch:
        patch.setattr(ChoosingPolicy, "selects", lambda self, num_pages: num_pages > self.num_fixed_pages)
        for reuse in (0, 2, 32):
            with build_llm(qwen3_dir, **opts, sparse_policy="QUEST", sparse_token_budget=3100,
                           num_reuse_cache_blocks=reuse) as llm:
                tokens, logits = generate_with_logits(llm, prompts, 48)
            assert tokens == ref[0], reuse
            assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(logits, ref[1])), reuse
    stats = {}
    for reuse in (0, 4):
        with build_llm(qwen3_dir, **opts, sparse_policy="QUEST", sparse_token_budget=64,
                       num_reuse_cache_blocks=reuse) as llm:
            stats[reuse] = generate_with_logits(llm, prompts, 48)[0], llm.get_sparse_stats()["decode"]
    assert stats[0][0] == stats[4][0]
    without, with_reuse = stats[0][1], stats[4][1]
    assert with_reuse["reused_host_pages"] > 0 and without["reused_host_pages"] == 0
    assert with_reuse["read_host_pages"] > 0 and without["reuse_rate"] is None  # counted with a reuse cache only
    assert with_reuse["loaded_host_bytes"] < without["loaded_host_bytes"]


@pytest.mark.parametrize("tiers", ["gpu", "host"])
@pytest.mark.parametrize("policy", ["QUEST", "QUEST-by-layer", "STREAMING"])
def test_choosing_decode_captured_in_graphs_equals_eager(qwen3_dir, policy, tiers):
    """Every sequence choosing, GPU-only and with most of the KV on the host tier (the gather of
    host pages, the reuse cache and the staging pages captured too): the steps replayed from the
    choosing graphs (three sequences padded to 4) give the eager engine's tokens, logits (1e-4,
    float32), reads and host traffic; with budgets that differ by layer too."""
    prompts = [random_prompt(n, seed=90 + n) for n in (1500, 2000, 2900)]
    opts = dict(max_model_len=3100, device="cuda", dtype="float32", max_num_seqs=4,
                sparse_policy=policy.split("-")[0], sparse_sink_tokens=16, sparse_recent_tokens=64)
    if policy.startswith("QUEST"):
        opts["sparse_token_budget"] = 128
    if policy == "QUEST-by-layer":
        opts["sparse_layer_budget_weights"] = (1.0, 3.0)  # 64 and 192 tokens per KV head
    if tiers == "host":
        opts.update(enable_cpu_offload=True, num_kvcache_blocks=12, num_cpu_kvcache_blocks=40, num_ring_slots=2)
    with build_llm(qwen3_dir, enforce_eager=True, **opts) as llm:
        ref_tokens, ref_logits = generate_with_logits(llm, prompts, 24)
        ref_reads = llm.get_sparse_stats()["decode"]
    with build_llm(qwen3_dir, enforce_eager=False, **opts) as llm:
        graphs = llm.model_runner.graphs
        assert sorted(graphs.choosing_graphs) == [1, 2, 4]
        replays = []
        replay = graphs.choosing_graphs[4].replay
        graphs.choosing_graphs[4].replay = lambda: (replays.append(1), replay())[1]
        tokens, logits = generate_with_logits(llm, prompts, 24)
        reads = llm.get_sparse_stats()["decode"]
    assert len(replays) >= 20
    assert tokens == ref_tokens
    assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(logits, ref_logits))
    assert reads["read_tokens"] == ref_reads["read_tokens"] and reads["density"] < 0.5
    if tiers == "host":
        # STREAMING reads its sinks (the first block) and its recent tokens (the last): both stay in the GPU tier
        assert (ref_reads["loaded_host_bytes"] > 0) == (policy != "STREAMING"), ref_reads["loaded_host_bytes"]
        for key in ("loaded_host_bytes", "available_host_bytes", "read_host_pages", "reused_host_pages"):
            assert reads[key] == ref_reads[key], key

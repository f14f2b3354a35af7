"""QUEST decode, per KV head at page granularity (nanovllm/sparse/quest.py, ops/quest_scores.py):
the key min/max bound, the scoring kernel against its reference (under Triton's interpreter here,
bfloat16 on the GPU in tests/gpu/test_quest_gpu.py), the per-head choice, its metadata across
tiers, the options, STREAMING, tensor parallelism (equality with FULL when every page is picked:
tests/test_tiers.py; the reuse cache: tests/test_reuse.py)."""
import math
import warnings

import numpy as np
import pytest
import torch

from _interpreter import interpreted_only, run_interpreted_tests
from _util import build_llm, generate_with_logits, greedy, random_prompt
from nanovllm.ops import quest_scores
from nanovllm.ops.quest_scores import (box_scores, box_scores_ref, page_bounds, page_bounds_ref, page_scores,
                                      page_scores_ref, top_pages, top_pages_ref)
from nanovllm.sparse import DecodeCandidates, QuestPolicy, StreamingPolicy
from nanovllm.sparse.choosing import ChoosingPolicy, check_layer_weights, layer_budget_pages


def _keys_and_bounds(pages, page_size, heads_kv, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(pages, page_size, heads_kv, dim, generator=gen)
    return keys, keys.amin(1), keys.amax(1)


@pytest.mark.parametrize("heads_q, heads_kv", [(4, 2), (6, 3), (2, 2)])
def test_bounds_bound_every_key_of_the_page_per_query_head(heads_q, heads_kv):
    keys, kmin, kmax = _keys_and_bounds(9, 16, heads_kv, 8)
    q = torch.randn(3, heads_q, 8)
    pages = torch.tensor([[0, 4, 8, -1], [1, 2, 3, 5], [7, -1, -1, -1]])
    bounds = page_bounds_ref(q, kmin, kmax, pages)
    group = heads_q // heads_kv
    for s in range(3):
        for c, page in enumerate(pages[s].tolist()):
            if page < 0:
                assert torch.isneginf(bounds[s, c]).all()
                continue
            for h in range(heads_q):
                scores = keys[page, :, h // group] @ q[s, h]
                assert scores.max() <= bounds[s, c, h] + 1e-5  # an upper bound over the page's keys
                exact = (torch.maximum(q[s, h] * kmin[page, h // group], q[s, h] * kmax[page, h // group])).sum()
                assert bounds[s, c, h] == pytest.approx(exact.item(), abs=1e-5)


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_page_scores_combine_each_query_heads_shares_within_its_group(combine):
    bounds = torch.randn(2, 5, 4)
    bounds[1, 3:] = float("-inf")  # not candidates
    scores = page_scores(bounds, 0.5, 2, combine)
    assert scores.shape == (2, 2, 5)
    shares = torch.softmax(bounds * 0.5, dim=1).nan_to_num(0.0).view(2, 5, 2, 2)
    expected = (shares.amax(3) if combine == "max" else shares.sum(3)).transpose(1, 2)
    assert torch.allclose(scores[0], expected[0])
    assert torch.allclose(scores[1, :, :3], expected[1, :, :3]) and torch.isneginf(scores[1, :, 3:]).all()
    with pytest.raises(ValueError, match="combine must be one of"):
        page_scores(bounds, 0.5, 2, "mean")


@pytest.mark.parametrize("shape", [(2, 1, 4), (2, 5, 1)], ids=["one-candidate", "one-query-head"])
def test_page_scores_leave_the_bounds_untouched(shape):
    """Shapes where the bounds transposed are already contiguous: the scaled logits are a copy."""
    bounds = torch.randn(shape)
    kept = bounds.clone()
    page_scores(bounds, 0.5, 1, "max")
    assert torch.equal(bounds, kept)


def test_box_scores_move_from_the_bound_to_the_center_with_the_radius_weight():
    _, kmin, kmax = _keys_and_bounds(6, 16, 2, 8)
    q = torch.randn(2, 4, 8)
    pages = torch.tensor([[0, 2, 5, -1], [1, 3, 4, 0]])
    upper = page_bounds_ref(q, kmin, kmax, pages)
    assert torch.equal(box_scores(q, kmin, kmax, pages, 1.0), upper)
    center = page_bounds_ref(q, (kmin + kmax) / 2, (kmin + kmax) / 2, pages)  # q . c
    assert torch.allclose(box_scores(q, kmin, kmax, pages, 0.0), center, atol=1e-5, equal_nan=True)
    radius = upper - center  # |q| . r
    got = box_scores(q, kmin, kmax, pages, 0.25)
    finite = torch.isfinite(upper)
    assert torch.allclose(got[finite], (center + 0.25 * radius)[finite], atol=1e-5)
    assert torch.isneginf(got[~finite]).all()
    with pytest.raises(ValueError, match="radius_weight must be in"):
        box_scores(q, kmin, kmax, pages, 1.5)


def test_top_pages_takes_each_heads_best_and_marks_missing_picks():
    scores = torch.tensor([[[0.1, 0.9, 0.5, float("-inf")], [0.8, 0.2, 0.3, float("-inf")]]])
    picks = top_pages(scores, 2).sort(dim=2).values
    assert picks.tolist() == [[[1, 2], [0, 2]]], "each KV head its own best pages"
    assert top_pages(scores, 4).sort(dim=2).values.tolist() == [[[-1, 0, 1, 2], [-1, 0, 1, 2]]]


@interpreted_only
@pytest.mark.parametrize("weight", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads_q, heads_kv, dim", [(4, 2, 32), (8, 8, 64), (6, 2, 40)])
def test_interpreted_page_bounds_kernel_equals_reference(dtype, heads_q, heads_kv, dim, weight):
    """The kernel's upper bounds (weight 1) and its one-launch box scores (weight < 1)."""
    _, kmin, kmax = _keys_and_bounds(200, 16, heads_kv, dim)
    kmin, kmax = kmin.to(dtype), kmax.to(dtype)
    q = torch.randn(3, heads_q, dim).to(dtype)
    pages = torch.randint(0, 200, (3, 130))
    pages[1, 70:] = -1
    if weight == 1.0:
        got, ref = page_bounds(q, kmin, kmax, pages), page_bounds_ref(q, kmin, kmax, pages)
    else:
        got, ref = box_scores(q, kmin, kmax, pages, weight), box_scores_ref(q, kmin, kmax, pages, weight)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert torch.allclose(got[finite], ref[finite], rtol=1e-3, atol=1e-3)


@interpreted_only
@pytest.mark.parametrize("combine", ["max", "sum"])
@pytest.mark.parametrize("heads_q, heads_kv, num_pages", [(4, 2, 300), (14, 2, 37), (3, 3, 600)])
def test_interpreted_page_scores_kernel_equals_reference(heads_q, heads_kv, num_pages, combine, monkeypatch):
    """The one-launch scores (online softmax per query head, combined per KV head) against the
    torch reference: GQA groups of 2, 7 (not a power of two) and 1, several tiles (of 64 bounds
    here), pages that are not candidates and a sequence with none."""
    monkeypatch.setattr(quest_scores, "_SCORES_TILE", 64)
    bounds = torch.randn(3, num_pages, heads_q) * 4
    bounds[1, num_pages // 2:] = float("-inf")
    bounds[2] = float("-inf")
    got, ref = page_scores(bounds, 0.3, heads_kv, combine), page_scores_ref(bounds, 0.3, heads_kv, combine)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)) and torch.isneginf(got[2]).all()
    finite = torch.isfinite(ref)
    assert torch.allclose(got[finite], ref[finite], rtol=1e-5, atol=1e-7)


@interpreted_only
@pytest.mark.parametrize("num_cols, k", [(7, 3), (300, 40), (2500, 700), (5, 9)])
def test_interpreted_top_pages_kernel_equals_reference(num_cols, k, monkeypatch):
    """The radix select takes the same columns as ``torch.topk`` (distinct scores; -inf for the
    columns that are not candidates, marked -1 in both), over one tile and several (tiles of 256
    here)."""
    monkeypatch.setattr(quest_scores, "_TOP_MAX_TILE", 256)
    scores = torch.randn(2, 3, num_cols)
    scores[0, 1, num_cols // 2:] = float("-inf")  # fewer candidates than k in some rows
    scores[1, 2, :] = -scores[1, 2, :].abs()  # negative scores only: the keys' sign handling
    got, ref = top_pages(scores, k), top_pages_ref(scores, k)
    assert got.shape == ref.shape == (2, 3, min(k, num_cols))
    assert torch.equal(got.sort(dim=2).values, ref.sort(dim=2).values)


@interpreted_only
def test_interpreted_top_pages_kernel_takes_ties_from_the_left():
    scores = torch.tensor([[[0.5, 2.0, 0.5, 1.0, 0.5, -0.0, 0.0]]])
    assert top_pages(scores, 3).tolist() == [[[0, 1, 3]]]
    assert top_pages(scores, 6).tolist() == [[[0, 1, 2, 3, 4, 6]]], "+0.0 above -0.0"


def test_page_scores_refuse_bounds_they_cannot_read():
    with pytest.raises(ValueError, match="float32"):
        page_scores(torch.zeros(2, 3, 4, dtype=torch.float16), 0.5, 2, "max")
    with pytest.raises(ValueError, match="float32"):
        page_scores(torch.zeros(3, 4), 0.5, 2, "max")


def test_top_pages_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="float32"):
        top_pages(torch.zeros(2, 3), 1)
    with pytest.raises(ValueError, match="k must be"):
        top_pages(torch.zeros(1, 1, 4), 0)


def test_triton_kernel_under_interpreter():
    run_interpreted_tests(__file__, min_passed=29)


def _policy(**kw):
    opts = dict(page_size=16, budget_tokens=32, sink_tokens=16, recent_tokens=16)
    opts.update(kw)
    return QuestPolicy(0.25, **opts)


def test_two_kv_heads_that_need_different_pages_each_read_their_own():
    """Head 0's query points at page 5's keys, head 1's at page 9's: each KV head picks its own
    pages (Quest chooses per head; one choice for all heads would serve one of them)."""
    policy = _policy(budget_tokens=16)  # one pick per head
    dim, heads = 8, 2
    policy.allocate(1, 256, heads, dim, torch.float32, torch.device("cpu"), 2, 0)
    direction = torch.zeros(heads, dim)
    direction[0, 0], direction[1, 1] = 1.0, 1.0
    policy.kmin.fill_(-0.1)
    policy.kmax.fill_(0.1)
    policy.kmax[0, 0, 5, 0, 0] = 8.0  # block 0, page 5, KV head 0, dim 0
    policy.kmax[0, 0, 9, 1, 1] = 8.0  # block 0, page 9, KV head 1, dim 1
    q = (direction * 3).repeat_interleave(2, 0)[None]  # [1, Hq=4, D]: GQA 2 query heads per KV head
    candidates = DecodeCandidates([0], torch.arange(1, 15)[None], first=1, num_kv_heads=2)  # metadata pages 1..14 of block 0
    picks = policy.select_decode_pages(0, q, candidates)
    assert picks.shape == (1, heads, 1)
    assert (picks[0, :, 0] + candidates.first).tolist() == [5, 9]


def test_metadata_follows_a_block_from_the_gpu_tier_to_the_host_tier():
    policy = _policy()
    policy.allocate(2, 64, 2, 8, torch.float32, torch.device("cpu"), 3, 4)
    k_cache = torch.randn(2, 3, 64, 2, 8)
    policy.on_pages_full(k_cache[:, [1]], torch.tensor([1]))
    pages = k_cache[:, 1].view(2, 4, 16, 2, 8)
    assert torch.equal(policy.kmin[:, 1], pages.amin(2)) and torch.equal(policy.kmax[:, 1], pages.amax(2))
    policy.on_spill(torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(policy.kmax[:, 3 + 2], policy.kmax[:, 1]), "host block 2 is metadata slot 3 + 2"
    assert policy.metadata_bytes_per_block(2, 64, 2, 8, torch.float32) == 2 * 2 * 4 * 2 * 8 * 4


def test_page_bounds_are_current_once_each_page_is_full(qwen3_dir):
    """The bounds of a page are computed after the step that fills it, not when its block fills:
    mid-block, every full page of the block being written has its keys' min and max (a candidate
    there with stale bounds would be scored from another sequence's keys)."""
    with build_llm(qwen3_dir, sparse_policy="QUEST", sparse_token_budget=64, sparse_sink_tokens=16,
                   sparse_recent_tokens=16) as llm:
        llm.add_request(random_prompt(300, seed=8), greedy(4))
        for _ in range(3):
            llm.step()
        seq = llm.scheduler.running[0]
        cache = llm.model_runner.cache
        block = seq.block_table[1]  # tokens 256..511: 300 + 2 written, so pages 0 and 1 are full
        pages = cache.kv[0][:, block].unflatten(1, (-1, 16))  # [L, pages, 16, Hkv, D]
        for page in range(2):
            assert torch.equal(cache.policy.kmin[:, block, page], pages[:, page].amin(1))
            assert torch.equal(cache.policy.kmax[:, block, page], pages[:, page].amax(1))
        while not llm.is_finished():
            llm.step()


def test_a_sequence_selects_only_with_more_candidates_than_its_budget():
    policy = _policy()  # 1 sink page, 1 recent page + the page being written, 2 picked pages
    assert policy.num_fixed_pages == 3 and policy.budget_pages == 2
    assert not policy.selects(5) and policy.selects(6)
    sink, tail = policy.fixed_pages(10)
    assert list(sink) == [0] and list(tail) == [8, 9]
    assert StreamingPolicy(0.25, 16, 16, 16).budget_pages == 0


def test_layer_weights_share_the_same_total_budget():
    """Layer l reads budget x w[l] / mean(w) tokens (whole pages, at least one); equal weights are
    the uniform budget; a sequence selects once some layer has fewer picks than candidates."""
    assert layer_budget_pages(64, 16, (1, 3)) == (2, 6)  # 128 tokens: 32 and 96
    assert layer_budget_pages(40, 16, (0.1,) * 3) == (3, 3, 3) == (math.ceil(40 / 16),) * 3
    assert layer_budget_pages(64, 16, (1e-6, 1.0)) == (1, 8)
    assert layer_budget_pages(64, 16, (1e308, 1e308)) == (4, 4), "no overflow in the mean"
    policy = _policy(budget_tokens=48, layer_weights=(1, 2))  # 32 and 64 tokens: 2 and 4 pages
    assert [policy.budget_at(layer) for layer in range(2)] == [2, 4] and policy.budget_pages == 4
    assert not policy.selects(3 + 2) and policy.selects(3 + 3)
    assert _policy(budget_tokens=48).budget_at(1) == 3
    assert check_layer_weights([1, 2.5], 2) == (1.0, 2.5)
    for bad, match in (((1, 2, 3), r"list or tuple of num_hidden_layers=2 weights, got \(1, 2, 3\)"),
                       ("12", "list or tuple of num_hidden_layers=2"), (5, "list or tuple"),
                       ({0: 1.0, 1: 1.0}, "list or tuple"), ({1.0, 2.0}, "list or tuple"),
                       (torch.ones(2), "list or tuple"), ((torch.tensor(1.0),) * 2, r"\[0\] must be a finite number"),
                       ((1, 0), r"sparse_layer_budget_weights\[1\] must be a finite number > 0, got 0"),
                       ((1, float("nan")), r"\[1\] must be a finite number > 0"), ((True, 1), r"\[0\]")):
        with pytest.raises(ValueError, match=match):
            check_layer_weights(bad, 2)


def test_density_counts_each_layers_budget(qwen3_dir):
    """With weights (1, 3) over 2 layers and 32 tokens per KV head, layer 0 picks 1 page and
    layer 1 picks 3 besides the 3 fixed pages: the same total reads as 2 pages at each layer,
    counted per layer; equal weights read and decode what no weights do."""
    prompt = random_prompt(600, seed=7)
    opts = dict(sparse_policy="QUEST", sparse_token_budget=32, sparse_sink_tokens=16, sparse_recent_tokens=16)
    runs = {}
    for weights in (None, (1.0, 3.0), (2.0, 2.0)):
        with build_llm(qwen3_dir, **opts, sparse_layer_budget_weights=weights) as llm:
            out = llm.generate([prompt], greedy(3), use_tqdm=False)[0]["token_ids"]
            stats = llm.get_sparse_stats()
        per_layer = [row["density"] for row in stats["decode"]["per_layer"]]
        runs[weights] = out, stats["decode"]["read_tokens"], per_layer
    lengths = (601, 602)  # the decode steps' lengths

    def density(pages):
        return sum(pages * 16 - (-n % 16) for n in lengths) / sum(lengths)

    assert runs[(1.0, 3.0)][1] == runs[None][1] == sum(2 * (5 * 16 - (-n % 16)) for n in lengths)
    assert runs[(1.0, 3.0)][2] == pytest.approx([density(3 + 1), density(3 + 3)])
    assert runs[None][2] == pytest.approx([density(5)] * 2)
    assert runs[(2.0, 2.0)] == runs[None]


def test_options_are_checked(qwen3_dir):
    from nanovllm.config import Config

    quest = dict(sparse_policy="QUEST", max_model_len=1024)
    for bad, match in ((dict(sparse_page_size=48), "sparse_page_size must be one of"),
                       (dict(sparse_page_size=64, kvcache_block_size=256), None),
                       (dict(sparse_token_budget=0), "sparse_token_budget must be >= 1"),
                       (dict(sparse_sink_tokens=2000), r"sparse_sink_tokens must be in \[0, 1024\]"),
                       (dict(sparse_recent_tokens=-1), r"sparse_recent_tokens must be in \[0, 1024\]"),
                       (dict(sparse_dense_layers=-1), r"sparse_dense_layers must be in \[0, 2\]"),
                       (dict(sparse_dense_layers=3), r"sparse_dense_layers must be in \[0, 2\], got 3"),
                       (dict(sparse_dense_layers=2), None),
                       (dict(sparse_group_score="mean"), "sparse_group_score must be one of"),
                       (dict(sparse_radius_weight=-0.5), r"sparse_radius_weight must be a number in \[0, 1\]"),
                       (dict(sparse_radius_weight=0.5), None),
                       (dict(sparse_layer_budget_weights=(1, 2, 3)), "list or tuple of num_hidden_layers=2 weights"),
                       (dict(sparse_layer_budget_weights=(1, -2)), r"sparse_layer_budget_weights\[1\] must be"),
                       (dict(sparse_layer_budget_weights=[1, 2]), None),
                       (dict(sparse_topk_blocks=2, sparse_token_budget=100), "both set the budget")):
        if match is None:
            Config(qwen3_dir, **quest, **bad)
            continue
        with pytest.raises(ValueError, match=match):
            Config(qwen3_dir, **quest, **bad)
    with pytest.warns(DeprecationWarning, match="sparse_topk_blocks is deprecated"):
        config = Config(qwen3_dir, **quest, sparse_topk_blocks=3)
    assert config.sparse_token_budget == 3 * 256 and config.sparse_topk_blocks is None
    with pytest.raises(ValueError, match="unknown engine argument"):
        build_llm(qwen3_dir, sparse_threshold_blocks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config(qwen3_dir, sparse_policy="STREAMING")
    with pytest.raises(ValueError, match="sparse_layer_budget_weights=.* is read by sparse_policy="):
        Config(qwen3_dir, sparse_policy="STREAMING", sparse_layer_budget_weights=(1, 1))
    with pytest.raises(ValueError, match="sparse_layer_budget_weights must be a list or tuple"):
        Config(qwen3_dir, sparse_policy="FULL", sparse_layer_budget_weights=np.ones(2))
    # the staging and reuse rows hold at most a context's pages, whatever the budget
    assert QuestPolicy.decode_pick_limit(Config(qwen3_dir, **quest)) == 1024
    assert QuestPolicy.decode_pick_limit(Config(qwen3_dir, **quest, sparse_token_budget=100,
                                                sparse_layer_budget_weights=(1, 3))) == 160


def test_streaming_reads_sinks_and_the_recent_window(qwen3_dir):
    """STREAMING reads each sequence's sink page and its recent pages; with a window covering the
    context it reads everything: FULL's tokens and logits."""
    prompts = [random_prompt(n, seed=500 + n) for n in (300, 700)]
    with build_llm(qwen3_dir) as full:
        ref = generate_with_logits(full, prompts, 8)
    with build_llm(qwen3_dir, sparse_policy="STREAMING", sparse_recent_tokens=1024) as llm:
        got = generate_with_logits(llm, prompts, 8)
        assert llm.get_sparse_stats()["decode"]["density"] == 1.0
    assert got[0] == ref[0] and all((a - b).abs().max() <= 1e-5 for a, b in zip(got[1], ref[1]))
    with build_llm(qwen3_dir, sparse_policy="STREAMING", sparse_sink_tokens=16, sparse_recent_tokens=64) as llm:
        llm.generate(prompts, greedy(4), use_tqdm=False)
        decode = llm.get_sparse_stats()["decode"]
    # each step: 1 sink page + 4 recent pages + the page being written, per sequence and layer
    assert decode["density"] < 0.5 and decode["read_tokens"] < decode["context_tokens"]


def test_density_counts_the_always_read_pages(qwen3_dir, monkeypatch):
    """A step of a choosing sequence reads its sink, recent and current pages and its picks: with
    one 16-token sink page, one recent page, the current page and 2 picks, 5 pages per KV head
    less the current page's unwritten tokens."""
    prompt = random_prompt(600, seed=7)
    with build_llm(qwen3_dir, sparse_policy="QUEST", sparse_token_budget=32, sparse_sink_tokens=16,
                   sparse_recent_tokens=16) as llm:
        llm.generate([prompt], greedy(3), use_tqdm=False)
        decode = llm.get_sparse_stats()["decode"]
    layers = llm.config.hf_config.num_hidden_layers
    # decode steps at lengths 601, 602 (the third token comes from the last step's logits)
    expected = sum(5 * 16 - (-length % 16) for length in (601, 602)) * layers
    assert decode["read_tokens"] == expected and decode["context_tokens"] == (601 + 602) * layers


@pytest.mark.slow
def test_quest_tensor_parallel_selects_like_tp1(llama_tied_dir):
    """Each rank chooses for its own KV heads (no scores exchanged), so TP=2 reads TP=1's pages
    and gives its tokens, in both tiers."""
    prompts = [random_prompt(n, seed=300 + n) for n in (1300, 1500)]
    opts = dict(max_model_len=1536, enable_cpu_offload=True, num_kvcache_blocks=6, num_ring_slots=2,
                num_cpu_kvcache_blocks=16, sparse_policy="QUEST", sparse_token_budget=64, sparse_sink_tokens=16,
                sparse_recent_tokens=32)
    with build_llm(llama_tied_dir, **opts) as tp1:
        ref = [o["token_ids"] for o in tp1.generate(prompts, greedy(30), use_tqdm=False)]
        assert tp1.get_kv_cache_stats()["spilled_blocks"] > 0
        assert tp1.get_sparse_stats()["decode"]["density"] < 0.5
    with build_llm(llama_tied_dir, tensor_parallel_size=2, **opts) as tp2:
        out = [o["token_ids"] for o in tp2.generate(prompts, greedy(30), use_tqdm=False)]
    assert out == ref


def test_budgets_by_layer_covering_the_context_equal_full(qwen3_dir, monkeypatch):
    """Every sequence choosing, with each layer's budget (1,024 and 3,072 tokens) over its
    candidates: QUEST picks them all at each layer and gives FULL's tokens and logits."""
    monkeypatch.setattr(ChoosingPolicy, "selects", lambda self, num_pages: num_pages > self.num_fixed_pages)
    prompts = [random_prompt(n, seed=600 + n) for n in (300, 700)]
    with build_llm(qwen3_dir) as full:
        ref = generate_with_logits(full, prompts, 6)
    with build_llm(qwen3_dir, sparse_policy="QUEST", sparse_token_budget=2048,
                   sparse_layer_budget_weights=(1, 3)) as llm:
        got = generate_with_logits(llm, prompts, 6)
        assert llm.get_sparse_stats()["decode"]["density"] == 1.0
    assert got[0] == ref[0] and all((a - b).abs().max() <= 1e-5 for a, b in zip(got[1], ref[1]))


def test_quest_with_prefix_cache_hits_equals_full(qwen3_dir, monkeypatch):
    """Prompts sharing a cached prefix: QUEST selecting every page reads the shared blocks where
    the prefix cache put them and gives FULL's tokens and logits."""
    monkeypatch.setattr(ChoosingPolicy, "selects", lambda self, num_pages: num_pages > self.num_fixed_pages)
    shared = random_prompt(512, seed=11)
    prompts = [shared + random_prompt(n, seed=12 + n) for n in (40, 300)]
    with build_llm(qwen3_dir) as full:
        full.generate([shared + [5]], greedy(1), use_tqdm=False)
        ref = generate_with_logits(full, prompts, 8)
    with build_llm(qwen3_dir, sparse_policy="QUEST", sparse_token_budget=1024) as llm:
        llm.generate([shared + [5]], greedy(1), use_tqdm=False)
        got = generate_with_logits(llm, prompts, 8)
        assert llm.get_kv_cache_stats()["prefix_cache_hit_tokens"] >= 2 * 512
    assert got[0] == ref[0] and all((a - b).abs().max() <= 1e-5 for a, b in zip(got[1], ref[1]))


def test_bench_offload_gives_the_full_baseline_none_of_the_policy_options():
    """``bench_offload.py --modes tiered,tiered-full --sparse-policy QUEST --sparse-token-budget N``:
    the QUEST mode takes the budget, the FULL baseline (which would refuse it) does not."""
    import types

    import bench_offload

    args = types.SimpleNamespace(input_len=1000, decode_tokens=8, block_size=256, num_seqs=1, enforce_eager=True,
                                 device="cpu", max_num_batched_tokens=512, sparse_policy="QUEST",
                                 num_kvcache_blocks=2, num_ring_slots=2, num_cpu_kvcache_blocks=-1,
                                 num_reuse_cache_blocks=-1, kv_cache_dtype="auto",
                                 **{name: None for name in bench_offload.SPARSE_OPTIONS})
    args.sparse_token_budget = 512
    quest, full = (bench_offload.engine_kwargs(args, mode) for mode in ("tiered", "tiered-full"))
    assert quest["sparse_policy"] == "QUEST" and quest["sparse_token_budget"] == 512
    assert full["sparse_policy"] == "FULL" and not set(bench_offload.SPARSE_OPTIONS) & set(full)


def test_bench_offload_rates_the_sequences_that_decode_together(qwen3_dir):
    """``bench_offload.py --num-seqs 3`` with a GPU tier that holds two: the sequences run in turns,
    and decode tok/s counts the one left in the last turn (``decode_batch``), not three."""
    import bench_offload

    argv = ["--model", qwen3_dir, "--device", "cpu", "--enforce-eager", "--input-len", "300", "--num-seqs", "3",
            "--decode-tokens", "4", "--block-size", "256", "--modes", "gpu"]
    crowded, roomy = (bench_offload.run_mode(bench_offload.parse_args(bench_offload.build_parser(), args), "gpu", {})
                      for args in (argv + ["--num-kvcache-blocks", "4"], argv))
    assert crowded["decode_batch"] == 1 and roomy["decode_batch"] == 3
    assert crowded["tokens"] == roomy["tokens"] and len(roomy["tokens"]) == 3
    for result in (crowded, roomy):  # the rate is the batch's tokens over the timed steps
        steps = 4 - 2
        seconds = result["tpot_ms"] / 1e3 * steps
        assert result["decode_tok_per_s"] == pytest.approx(result["decode_batch"] * steps / seconds, rel=0.01)


def test_bench_offload_bound_counts_a_choosing_policys_reads_and_metadata(qwen3_dir):
    """``bench_offload._hbm_seconds``: FULL's GPU side reads every used block; QUEST's reads its
    decode density's share of them plus every used block's key bounds."""
    import bench_offload

    bw = {"hbm_gb_per_s": 1.0, "pinned_h2d_gb_per_s": 1.0}
    prompt = random_prompt(900, seed=11)
    bounds = {}
    for policy in ("FULL", "QUEST"):
        opts = dict(sparse_policy=policy, sparse_token_budget=64) if policy == "QUEST" else {}
        with build_llm(qwen3_dir, **opts) as llm:
            llm.add_request(prompt, greedy(8))
            bench_offload.step_until_decoding(llm)
            llm.step(), llm.step()  # two decode steps, the sequence still running
            stats = llm.get_kv_cache_stats()
            cache = llm.model_runner.cache
            weights = sum(p.numel() * p.element_size() for p in llm.model_runner.model.parameters())
            kv = stats["gpu_blocks_used"] * cache.geometry.block_bytes
            density = llm.get_sparse_stats()["decode"]["density"] if policy == "QUEST" else 1.0
            meta = (stats["gpu_blocks_used"] + stats["host_blocks_used"]) * cache.metadata_bytes_per_block()
            assert stats["gpu_blocks_used"] > 0 and (policy == "FULL" or (0 < density < 1 and meta > 0))
            bounds[policy] = bench_offload._hbm_seconds(llm, stats, bw)
            assert bounds[policy] == pytest.approx((kv * density + (meta if policy == "QUEST" else 0) + weights) / 1e9)
    assert bounds["QUEST"] != bounds["FULL"]


def test_bench_offload_reports_the_progress_of_a_prompt_prefilled_in_chunks(qwen3_dir, capsys):
    """``bench_offload.step_until_decoding``: a prompt prefilled in chunks waits until its last
    chunk; the progress lines count its computed tokens all the same."""
    import re

    import bench_offload

    with build_llm(qwen3_dir, max_num_batched_tokens=256) as llm:
        llm.add_request(random_prompt(900, seed=12), greedy(2))
        bench_offload.step_until_decoding(llm, report_every_s=0.0)
    counts = [int(n) for n in re.findall(r"prefill: (\d+) tokens computed", capsys.readouterr().err)]
    assert {256, 512, 768} <= set(counts) and max(counts) <= 900, counts


def test_bench_selection_host_runs_the_policys_scoring_on_cpu(capsys):
    """``benchmarks/bench_selection_host.py --score``: the policy built from the benchmark's options
    (every option ``from_config`` reads) times a step with and without the reuse cache."""
    import json

    from benchmarks.bench_selection_host import main

    main(["--device", "cpu", "--score", "--layers", "2", "--blocks", "4", "--block-size", "256", "--budget", "256",
          "--steps", "1", "--warmup", "0", "--rounds", "1", "--radius-weight", "0.25"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["radius_weight"] == 0.25 and report["score"]
    assert report["no_reuse"]["reuse_rows"] == 0 and report["reuse"]["reuse_rows"] > 0


def test_bench_offload_counts_the_host_pages_quest_selects_reuse_hits_included(qwen3_dir):
    """``bench_offload.py --modes tiered --sparse-policy QUEST``: the selected host bytes per decode
    step are the policy's host (page, KV head) reads at their bytes, hits of the reuse cache
    included, so at least the bytes moved; FULL reports none."""
    import bench_offload

    argv = ["--model", qwen3_dir, "--device", "cpu", "--enforce-eager", "--input-len", "1000", "--decode-tokens", "6",
            "--block-size", "256", "--num-kvcache-blocks", "2", "--sparse-policy", "QUEST",
            "--sparse-token-budget", "128", "--sparse-recent-tokens", "32"]
    args = bench_offload.parse_args(bench_offload.build_parser(), argv)
    quest = bench_offload.run_mode(args, "tiered", {})
    full = bench_offload.run_mode(args, "tiered-full", {})
    selected, moved = quest["selected_host_bytes_per_decode_step"], quest["host_bytes_per_decode_step"]
    assert selected >= moved > 0
    assert quest["sparse_stats"]["decode"]["reuse_rate"] > 0 and selected > moved  # hits: selected, not moved
    assert "selected_host_bytes_per_decode_step" not in full and full["host_bytes_per_decode_step"] > 0

"""The decode reuse cache (nanovllm/kvcache/reuse.py): per (layer, KV head) cells of GPU rows
holding host pages read in recent steps, kept on the device; and the staging pages and groups of
a choosing decode step (nanovllm/kvcache/selection.py, tier_rows.py). Equality with FULL through
the cache: tests/test_tiers.py."""
import pytest
import torch

from _util import build_llm, generate_with_logits, random_prompt
from nanovllm.kvcache.reuse import ReuseCache

STAGING = 1000


def _cache(rows=1, pages_per_block=2, heads=2):
    # one layer; its rows: 4 GPU blocks then the reuse rows (cell pages 8, 9, ...)
    return ReuseCache(num_layers=1, num_kv_heads=heads, num_rows=rows, first_row=4, layer_rows=4 + rows,
                      pages_per_block=pages_per_block, device=torch.device("cpu"))


def test_misses_fill_free_cells_then_staging_and_hit_the_next_step():
    cache = _cache(rows=1)  # 2 cells per head, cell pages 8 and 9
    cache.begin_step()
    host = torch.tensor([[3, 5, 7, -1], [3, -1, -1, -1]])  # head 0 reads 3 host pages, head 1 one
    pages, miss = cache.place(0, host, STAGING)
    assert miss.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert pages.tolist() == [[8, 9, STAGING, -1], [8, -1, -1, -1]], "cells first, the third miss staged"
    cache.begin_step()
    pages, miss = cache.place(0, host, STAGING)
    assert pages[0, :2].tolist() == [8, 9] and not miss[0, :2].any(), "hits in the cells they filled"
    assert miss[0, 2] and pages[0, 2] == STAGING, "no free cell: every cell was read this step"
    assert pages[1, 0] == 8 and not miss[1, 0], "each head keeps its own pages"


def test_a_miss_takes_the_least_recently_used_cell_and_never_one_read_this_step():
    cache = _cache(rows=2, pages_per_block=2, heads=1)  # 4 cells: pages 8..11
    for step, pages in enumerate(([1, 2, 3, 4], [1, 2], [3])):
        cache.begin_step()
        cache.place(0, torch.tensor([pages]), STAGING)
    # last use: page 4 at step 1 (oldest), 1 and 2 at step 2, 3 at step 3
    cache.begin_step()
    pages, miss = cache.place(0, torch.tensor([[3, 9, 8]]), STAGING)
    assert not miss[0, 0] and miss[0, 1:].all()
    # free cells: 0, 1 (pages 1, 2, read at step 2) and 3 (page 4, step 1): oldest first
    assert cache.held[0, 0].tolist() == [8, 2, 3, 9], "9 took page 4's cell, 8 page 1's"
    assert pages[0].tolist() == [8 + 2, 8 + 3, 8 + 0]


def test_forget_drops_the_pages_of_rewritten_host_blocks():
    cache = _cache(rows=1, pages_per_block=2, heads=1)
    cache.begin_step()
    cache.place(0, torch.tensor([[4, 7]]), STAGING)  # host pages 4 (block 2) and 7 (block 3)
    cache.forget(torch.tensor([2]))
    assert cache.held[0, 0].tolist() == [-1, 7]
    cache.begin_step()
    pages, miss = cache.place(0, torch.tensor([[4, 7]]), STAGING)
    assert miss.tolist() == [[True, False]] and pages[0, 0] == 8, "refilled into the freed cell"


def test_reuse_cache_option_is_checked(qwen3_dir):
    from nanovllm.config import Config
    from nanovllm.kvcache.reuse import reuse_cache_rows

    quest = dict(enable_cpu_offload=True, sparse_policy="QUEST", sparse_token_budget=3 * 256)
    assert reuse_cache_rows(Config(qwen3_dir, **quest)) == 6, "default: two cells per picked page"
    assert reuse_cache_rows(Config(qwen3_dir, **quest, num_reuse_cache_blocks=5)) == 5
    assert reuse_cache_rows(Config(qwen3_dir, **quest, num_reuse_cache_blocks=0)) == 0
    with build_llm(qwen3_dir, sparse_policy="QUEST") as llm:
        assert llm.model_runner.cache.reuse_rows == 0, "no host tier"
    for bad, match in ((-2, r"num_reuse_cache_blocks must be -1 \(sized automatically\) or an integer >= 0, got -2"),
                       (1.5, r"num_reuse_cache_blocks must be -1 .* got 1.5")):
        with pytest.raises(ValueError, match=match):
            Config(qwen3_dir, **quest, num_reuse_cache_blocks=bad)
    with pytest.raises(ValueError, match="num_reuse_cache_blocks=2 needs enable_cpu_offload=True"):
        Config(qwen3_dir, sparse_policy="QUEST", num_reuse_cache_blocks=2)
    with pytest.raises(ValueError, match="and sparse_policy='QUEST' or 'STREAMING'"):
        Config(qwen3_dir, enable_cpu_offload=True, num_reuse_cache_blocks=2)
    with pytest.raises(ValueError, match="at least 1 row"):
        _cache(rows=0)


def test_reuse_cache_and_staging_rows_follow_the_gpu_tier_and_are_budgeted(qwen3_dir):
    from nanovllm.kvcache.tier_rows import STAGING_SEQS, staging_rows

    with build_llm(qwen3_dir, enable_cpu_offload=True, num_cpu_kvcache_blocks=8, num_ring_slots=2,
                   sparse_policy="QUEST", num_reuse_cache_blocks=3) as llm:
        cache, gpu_blocks, config = llm.model_runner.cache, llm.get_kv_cache_stats()["gpu_blocks"], llm.config
        g = cache.geometry
        assert cache.kv.shape[2] == gpu_blocks + 3
        assert cache.attention.reuse.cell_pages(0)[0] == gpu_blocks * (g.block_size // config.sparse_page_size)
        page = config.sparse_page_size
        picks = min(config.sparse_token_budget, config.max_model_len)  # no step has more candidates
        assert picks == config.max_model_len < config.sparse_token_budget and picks % page == 0
        tokens = picks + (1 + 16 + 1) * page  # picks, sink, recent, current
        staging = -(-tokens * min(config.max_num_seqs, STAGING_SEQS) // g.block_size)
        assert cache.staging_rows == staging_rows(config) == staging
        assert cache.attention.k_rows.shape[0] == cache.layout.total == g.num_layers * (gpu_blocks + 3) + staging
        assert cache.attention.k_rows.data_ptr() == cache.kv[0, 0, 0].data_ptr(), "one table of rows"
        assert cache.reserved_bytes(8) == (2 + staging) * g.layer_block_bytes + 8 * cache.metadata_bytes_per_block() \
            + 3 * g.block_bytes


def test_groups_reuse_the_staging_pages_and_equal_full(qwen3_dir, monkeypatch):
    """Staging pages for one sequence's reads: a step whose host reads could overflow them reads
    its sequences in groups, each gathering into the same staging pages; FULL's tokens and logits
    (QUEST made to select, with a budget covering the context)."""
    from nanovllm.kvcache import tier_rows
    from nanovllm.kvcache.selection import DecodeSelection
    from nanovllm.sparse.choosing import ChoosingPolicy

    monkeypatch.setattr(ChoosingPolicy, "selects", lambda self, num_pages: num_pages > self.num_fixed_pages)
    monkeypatch.setattr(tier_rows, "STAGING_SEQS", 1)
    groups = []
    build = DecodeSelection.build.__func__

    def recording_build(cls, *args, **kwargs):
        selection = build(cls, *args, **kwargs)
        if selection is not None:
            groups.append(len(selection.groups))
        return selection

    monkeypatch.setattr(DecodeSelection, "build", classmethod(recording_build))
    prompts = [random_prompt(n, seed=40 + n) for n in (1300, 1400, 1200)]
    opts = dict(max_model_len=1536, num_kvcache_blocks=6, enable_cpu_offload=True, num_cpu_kvcache_blocks=24)
    with build_llm(qwen3_dir, **opts) as full:
        ref = generate_with_logits(full, prompts, 6)
    with build_llm(qwen3_dir, **opts, sparse_policy="QUEST", sparse_token_budget=1536,
                   num_reuse_cache_blocks=0) as llm:
        got = generate_with_logits(llm, prompts, 6)
    assert max(groups) > 1
    assert got[0] == ref[0] and all((a - b).abs().max() <= 1e-5 for a, b in zip(got[1], ref[1]))


def test_a_reuse_cache_too_large_to_allocate_is_named(qwen3_dir):
    with pytest.raises(RuntimeError, match="10000000000 reuse-cache rows \\(num_reuse_cache_blocks"):
        build_llm(qwen3_dir, enable_cpu_offload=True, num_kvcache_blocks=8, num_cpu_kvcache_blocks=8,
                  sparse_policy="QUEST", num_reuse_cache_blocks=10**10)

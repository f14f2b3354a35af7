"""LLM.get_sparse_stats() / reset_sparse_stats(): compute and communication densities of the
sparse policies, counted on the policy instance (tiny random Llama, CPU, float32)."""
import pytest

from _util import greedy, random_prompt
from nanovllm.sparse import SparseStats

TIERED = dict(max_model_len=1536, enable_cpu_offload=True, num_kvcache_blocks=2, num_ring_slots=2,
              num_cpu_kvcache_blocks=16)
LAYERS = 2  # of the llama_tied fixture
PAGE = 16  # sparse_page_size's default
BLOCK_KV = 2 * 256 * 2 * 64 * 4  # bytes of one layer's keys and values of a 256-token block (2 KV heads x 64, fp32)
PAGE_KV = BLOCK_KV // (256 // PAGE)  # bytes of one page's keys and values, all KV heads
DECODE_STEPS = 19  # of a 20-token generation (the first token comes from the prefill)


def _generate(llm, prompt_len: int, max_tokens: int = 20):
    llm.generate([random_prompt(prompt_len, seed=prompt_len)], greedy(max_tokens), use_tqdm=False)
    return llm.get_sparse_stats()


def _steps(prompt_len: int) -> range:
    """The context lengths of the decode steps of a 20-token generation."""
    return range(prompt_len + 1, prompt_len + 1 + DECODE_STEPS)


def _read_tokens(prompt_len: int, budget_pages: int, fixed_pages: int = 18) -> int:
    """Tokens one KV head reads over the decode steps: a step whose context has more than
    ``budget_pages`` candidates besides its ``fixed_pages`` (sink, 16 recent, current) reads
    those and its picks (the last page filled up to the current token), any other every token."""
    def read(n):
        pages = -(-n // PAGE)
        return (fixed_pages + budget_pages) * PAGE - (-n % PAGE) if pages - fixed_pages > budget_pages else n
    return sum(read(n) for n in _steps(prompt_len))


def test_full_counts_every_host_block(llm_factory, llama_tied_dir):
    """700 tokens on a 2-block GPU tier: the first chunk fills both GPU blocks (512 tokens); the
    second spills block 1 to the host tier and gathers it for its prefix (1 host block per layer);
    each of the 19 decode steps reads it back (1 per layer)."""
    llm = llm_factory(llama_tied_dir, **TIERED)
    stats = _generate(llm, 700)
    assert stats["policy"] == "FULL"
    prefill, decode = stats["prefill"], stats["decode"]
    assert prefill["density"] == 1.0 and prefill["comm_density"] == 1.0
    assert prefill["loaded_host_bytes"] == prefill["available_host_bytes"] == 1 * LAYERS * BLOCK_KV
    assert prefill["kept_blocks"] is None
    assert decode["comm_density"] == 1.0 and decode["available_host_bytes"] == DECODE_STEPS * 1 * LAYERS * BLOCK_KV
    assert decode["read_tokens"] is None and decode["density"] == 1.0, "FULL reads every token"
    assert [row["layer"] for row in prefill["per_layer"]] == [0, 1]
    assert all(row == {"layer": row["layer"], "density": 1.0, "comm_density": 1.0} for row in prefill["per_layer"])
    llm.reset_sparse_stats()
    after = llm.get_sparse_stats()
    assert after["prefill"]["comm_density"] is None and after["decode"]["available_host_bytes"] == 0
    assert after["prefill"]["density"] == 1.0, "FULL's prefill is dense by definition"


def test_quest_reports_decode_communication(llm_factory, llama_tied_dir):
    """1300 tokens, 4 of its 6 blocks on the host: each step and KV head reads the sink page, 4
    picks, 16 recent pages and the current page (22 of ~82 pages), the host's among them through
    the reuse cache (the recent pages are read again step after step)."""
    llm = llm_factory(llama_tied_dir, sparse_policy="QUEST", sparse_token_budget=4 * PAGE, **TIERED)
    stats = _generate(llm, 1300)
    assert stats["policy"] == "QUEST"
    assert stats["prefill"]["density"] == 1.0 and stats["prefill"]["comm_density"] == 1.0
    decode = stats["decode"]
    assert decode["available_host_bytes"] == DECODE_STEPS * 4 * LAYERS * BLOCK_KV
    reads = DECODE_STEPS * 22 * 2 * LAYERS  # (page, KV head) reads
    assert 0 < decode["read_host_pages"] <= reads
    assert 0 < decode["reused_host_pages"] < decode["read_host_pages"]
    misses = decode["read_host_pages"] - decode["reused_host_pages"]
    assert decode["loaded_host_bytes"] == misses * PAGE_KV // 2, "a miss gathers one page of one KV head"
    assert decode["comm_density"] == pytest.approx(decode["loaded_host_bytes"] / decode["available_host_bytes"])
    assert decode["read_tokens"] == _read_tokens(1300, 4) * LAYERS
    assert decode["context_tokens"] == sum(_steps(1300)) * LAYERS
    assert decode["density"] == pytest.approx(decode["read_tokens"] / decode["context_tokens"])
    assert [row["density"] for row in decode["per_layer"]] == [pytest.approx(decode["density"])] * LAYERS


@pytest.mark.parametrize("prompt_lens", [[1300], [600], [1300, 600]])
def test_quest_without_the_host_tier_reports_the_share_of_the_kv_it_reads(llm_factory, llama_tied_dir, prompt_lens):
    """A 20-page budget: 1300 tokens (~82 pages) read the sink page, 20 picks, 16 recent pages
    and the current one; 600 tokens read everything until their context passes 608 tokens (38
    pages: 20 candidates, too few to select; alone: steps without a selection; beside the
    1300-token one: a row that does not choose in a step that selects)."""
    llm = llm_factory(llama_tied_dir, max_model_len=1536, sparse_policy="QUEST", sparse_token_budget=20 * PAGE,
                      max_num_seqs=2)
    prompts = [random_prompt(n, seed=n) for n in prompt_lens]
    llm.generate(prompts, greedy(20), use_tqdm=False)
    decode = llm.get_sparse_stats()["decode"]
    read = sum(_read_tokens(n, 20) for n in prompt_lens)
    assert (decode["read_tokens"], decode["context_tokens"]) == (read * LAYERS, sum(sum(_steps(n)) for n in prompt_lens) * LAYERS)
    assert decode["density"] == pytest.approx(decode["read_tokens"] / decode["context_tokens"])
    assert decode["comm_density"] is None
    llm.reset_sparse_stats()
    assert llm.get_sparse_stats()["decode"]["density"] is None, "nothing counted since the reset"


def test_gpu_only_full_has_no_communication(llm_factory, llama_tied_dir):
    llm = llm_factory(llama_tied_dir)
    stats = _generate(llm, 600)
    assert stats == {"policy": "FULL",
                     "prefill": {"density": 1.0, "comm_density": None, "loaded_host_bytes": 0,
                                 "available_host_bytes": 0, "per_layer": [], "kept_blocks": None,
                                 "visible_blocks": None},
                     "decode": {"comm_density": None, "loaded_host_bytes": 0, "available_host_bytes": 0,
                                "per_layer": [], "reuse_rate": None, "reused_host_pages": 0,
                                "read_host_pages": 0, "density": 1.0, "read_tokens": None,
                                "context_tokens": None}}


def test_stats_sum_per_layer_and_stay_on_the_device_until_read():
    import torch

    stats = SparseStats()
    stats.add_compute(0, torch.tensor(3), 4)
    stats.add_compute(0, 2, 4)
    stats.add_compute(1, torch.tensor(1), 8)
    stats.add_comm(1, True, 1, 4)
    assert isinstance(stats._kept[0], torch.Tensor), "kept counts accumulate without a host sync"
    prefill = stats.to_dict(dense_prefill=False, dense_decode=True)["prefill"]
    assert prefill["density"] == pytest.approx(6 / 16) and prefill["kept_blocks"] == 6
    assert prefill["per_layer"] == [{"layer": 0, "comm_density": None, "density": pytest.approx(5 / 8)},
                                    {"layer": 1, "comm_density": 0.25, "density": 0.125}]

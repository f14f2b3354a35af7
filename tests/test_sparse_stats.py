"""LLM.get_sparse_stats() / reset_sparse_stats(): compute and communication densities of the
sparse policies, counted on the policy instance (tiny random Llama, CPU, float32)."""
import pytest

from _util import greedy, random_prompt
from nanovllm.sparse import SparseStats

TIERED = dict(max_model_len=1536, enable_cpu_offload=True, num_kvcache_blocks=2, num_ring_slots=2,
              num_cpu_kvcache_blocks=16)
LAYERS = 2  # of the llama_tied fixture


def _generate(llm, prompt_len: int, max_tokens: int = 20):
    llm.generate([random_prompt(prompt_len, seed=prompt_len)], greedy(max_tokens), use_tqdm=False)
    return llm.get_sparse_stats()


def test_full_counts_every_host_block(llm_factory, llama_tied_dir):
    """700 tokens on a 2-block GPU tier: the first chunk fills both GPU blocks (512 tokens); the
    second spills block 1 to the host tier and gathers it for its prefix (1 host block per layer);
    each of the 19 decode steps reads it back (1 per layer)."""
    llm = llm_factory(llama_tied_dir, **TIERED)
    stats = _generate(llm, 700)
    assert stats["policy"] == "FULL"
    prefill, decode = stats["prefill"], stats["decode"]
    assert prefill["density"] == 1.0 and prefill["comm_density"] == 1.0
    assert prefill["loaded_host_blocks"] == prefill["available_host_blocks"] == 1 * LAYERS
    assert prefill["kept_blocks"] is None
    assert decode["comm_density"] == 1.0 and decode["available_host_blocks"] == 19 * 1 * LAYERS
    assert [row["layer"] for row in prefill["per_layer"]] == [0, 1]
    assert all(row == {"layer": row["layer"], "density": 1.0, "comm_density": 1.0} for row in prefill["per_layer"])
    llm.reset_sparse_stats()
    after = llm.get_sparse_stats()
    assert after["prefill"]["comm_density"] is None and after["decode"]["available_host_blocks"] == 0
    assert after["prefill"]["density"] == 1.0, "FULL's prefill is dense by definition"


def test_quest_reports_decode_communication(llm_factory, llama_tied_dir):
    llm = llm_factory(llama_tied_dir, sparse_policy="QUEST", sparse_topk_blocks=1, sparse_threshold_blocks=2,
                      **TIERED)
    stats = _generate(llm, 1300)  # 6 blocks, 4 of them on the host; decode reads 3 blocks in all
    assert stats["policy"] == "QUEST"
    assert stats["prefill"]["density"] == 1.0 and stats["prefill"]["comm_density"] == 1.0
    decode = stats["decode"]
    assert 0 < decode["loaded_host_blocks"] < decode["available_host_blocks"] == 19 * 4 * LAYERS
    assert decode["loaded_host_blocks"] <= 19 * 2 * LAYERS, "at most the middle pick and the sink per step"
    # every step reads the first block, the two last and one pick: 4 of 6 blocks
    assert (decode["kept_blocks"], decode["visible_blocks"]) == (19 * 4 * LAYERS, 19 * 6 * LAYERS)
    assert decode["density"] == pytest.approx(4 / 6)
    assert [row["density"] for row in decode["per_layer"]] == [pytest.approx(4 / 6)] * LAYERS


@pytest.mark.parametrize("prompt_lens, read", [([1300], 4), ([600], 3), ([1300, 600], 4 + 3)])
def test_quest_without_the_host_tier_reports_the_share_of_the_kv_it_reads(llm_factory, llama_tied_dir, prompt_lens,
                                                                           read):
    """1300 tokens: 6 blocks of 256, the first, the two last and one pick read; 600 tokens: 3
    blocks, too few to select, all read (alone: a step without a selection; beside the 1300-token
    one: a row that does not choose in a step that selects)."""
    llm = llm_factory(llama_tied_dir, max_model_len=1536, sparse_policy="QUEST", sparse_topk_blocks=1,
                      sparse_threshold_blocks=2, max_num_seqs=2)
    prompts = [random_prompt(n, seed=n) for n in prompt_lens]
    llm.generate(prompts, greedy(20), use_tqdm=False)
    decode = llm.get_sparse_stats()["decode"]
    blocks = sum(-(-n // 256) for n in prompt_lens)
    assert (decode["kept_blocks"], decode["visible_blocks"]) == (19 * read * LAYERS, 19 * blocks * LAYERS)
    assert decode["density"] == pytest.approx(read / blocks) and decode["comm_density"] is None
    llm.reset_sparse_stats()
    assert llm.get_sparse_stats()["decode"]["density"] is None, "nothing counted since the reset"


def test_gpu_only_full_has_no_communication(llm_factory, llama_tied_dir):
    llm = llm_factory(llama_tied_dir)
    stats = _generate(llm, 600)
    assert stats == {"policy": "FULL",
                     "prefill": {"density": 1.0, "comm_density": None, "loaded_host_blocks": 0,
                                 "available_host_blocks": 0, "per_layer": [], "kept_blocks": None,
                                 "visible_blocks": None},
                     "decode": {"comm_density": None, "loaded_host_blocks": 0, "available_host_blocks": 0,
                                "per_layer": [], "reuse_rate": None, "reused_host_blocks": 0,
                                "selected_host_blocks": 0, "density": 1.0, "kept_blocks": None,
                                "visible_blocks": None}}


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

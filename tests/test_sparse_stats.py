"""LLM.get_sparse_stats() / reset_sparse_stats(): compute and communication densities of the
sparse policies, counted on the policy instance (tiny random Llama, CPU, float32)."""
import pytest

from _util import build_llm, greedy, random_prompt
from nanovllm.kvcache.sparse import SparseStats

OFFLOAD = dict(max_model_len=1536, enable_cpu_offload=True, num_gpu_blocks=2, num_cpu_kvcache_blocks=16)
LAYERS = 2  # of the llama_tied fixture


def _generate(llm, prompt_len: int, max_tokens: int = 20):
    llm.generate([random_prompt(prompt_len, seed=prompt_len)], greedy(max_tokens), use_tqdm=False)
    return llm.get_sparse_stats()


def test_full_offload_counts_every_block(llm_factory, llama_tied_dir):
    llm = llm_factory(llama_tied_dir, **OFFLOAD)
    stats = _generate(llm, 700)  # 3 chunks of 256: 0 + 1 + 2 earlier blocks; decode reads 3
    assert stats["policy"] == "FULL"
    prefill, decode = stats["prefill"], stats["decode"]
    assert prefill["density"] == 1.0 and prefill["comm_density"] == 1.0
    assert prefill["loaded_cpu_blocks"] == prefill["available_cpu_blocks"] == 3 * LAYERS
    assert prefill["estimate_k_loads"] == 0 and prefill["kept_blocks"] is None
    assert decode["comm_density"] == 1.0 and decode["available_cpu_blocks"] == 19 * 3 * LAYERS
    assert [row["layer"] for row in prefill["per_layer"]] == [0, 1]
    assert all(row == {"layer": row["layer"], "density": 1.0, "comm_density": 1.0} for row in prefill["per_layer"])
    llm.reset_sparse_stats()
    after = llm.get_sparse_stats()
    assert after["prefill"]["comm_density"] is None and after["decode"]["available_cpu_blocks"] == 0
    assert after["prefill"]["density"] == 1.0, "FULL's prefill is dense by definition"


def test_quest_reports_decode_communication(llm_factory, llama_tied_dir):
    llm = llm_factory(llama_tied_dir, sparse_policy="QUEST", sparse_topk_blocks=1, sparse_threshold_blocks=2,
                      **OFFLOAD)
    stats = _generate(llm, 1300)  # 6 host blocks; decode loads the first, the last and 1 more
    assert stats["policy"] == "QUEST"
    assert stats["prefill"]["density"] == 1.0 and stats["prefill"]["comm_density"] == 1.0
    assert stats["decode"]["comm_density"] == pytest.approx(0.5)
    assert stats["decode"]["loaded_cpu_blocks"] == 19 * 3 * LAYERS
    assert all(row["comm_density"] == pytest.approx(0.5) for row in stats["decode"]["per_layer"])


def test_gpu_only_full_has_no_communication(llm_factory, llama_tied_dir):
    llm = llm_factory(llama_tied_dir)
    stats = _generate(llm, 600)
    assert stats == {"policy": "FULL",
                     "prefill": {"density": 1.0, "comm_density": None, "loaded_cpu_blocks": 0,
                                 "available_cpu_blocks": 0, "per_layer": [], "kept_blocks": None,
                                 "visible_blocks": None, "estimate_k_loads": 0},
                     "decode": {"comm_density": None, "loaded_cpu_blocks": 0, "available_cpu_blocks": 0,
                                "per_layer": []}}


def test_stats_sum_per_layer_and_stay_on_the_device_until_read():
    import torch

    stats = SparseStats()
    stats.add_compute(0, torch.tensor(3), 4)
    stats.add_compute(0, 2, 4)
    stats.add_compute(1, torch.tensor(1), 8)
    stats.add_comm(1, True, 1, 4)
    assert isinstance(stats._kept[0], torch.Tensor), "kept counts accumulate without a host sync"
    prefill = stats.to_dict(dense_prefill=False)["prefill"]
    assert prefill["density"] == pytest.approx(6 / 16) and prefill["kept_blocks"] == 6
    assert prefill["per_layer"] == [{"layer": 0, "comm_density": None, "density": pytest.approx(5 / 8)},
                                    {"layer": 1, "comm_density": 0.25, "density": 0.125}]

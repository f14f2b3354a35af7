"""The policies that score pages on QUEST's plan (ORACLE: exact attention mass; MOMENTS: a
Gaussian estimate from the keys' mean and variance) in the engine: FULL's tokens and logits when
the budget covers the context, and the same picks over the host tier as in the GPU tier (their
metadata moves with the blocks). Their scores: tests/test_oracle.py, tests/test_moments.py."""
import pytest

from _util import build_llm, generate_with_logits, random_prompt

SEEDS = {"ORACLE": (700, 800), "MOMENTS": (900, 950)}


@pytest.mark.parametrize("policy", sorted(SEEDS))
def test_a_budget_covering_the_context_gives_full_tokens_and_logits(qwen3_dir, policy):
    prompts = [random_prompt(n, seed=SEEDS[policy][0] + n) for n in (500, 900)]
    with build_llm(qwen3_dir) as full:
        ref = generate_with_logits(full, prompts, 8)
    with build_llm(qwen3_dir, sparse_policy=policy, sparse_token_budget=1024, sparse_sink_tokens=16,
                   sparse_recent_tokens=16) as llm:
        got = generate_with_logits(llm, prompts, 8)
    assert got[0] == ref[0] and all((a - b).abs().max() <= 1e-5 for a, b in zip(got[1], ref[1]))


@pytest.mark.parametrize("policy", sorted(SEEDS))
def test_over_the_host_tier_it_reads_what_it_reads_in_the_gpu_tier(qwen3_dir, policy):
    """A small budget (it selects): the same tokens and logits with the prompts' blocks spilled to
    the host tier as with everything in the GPU tier."""
    prompts = [random_prompt(n, seed=SEEDS[policy][1] + n) for n in (1200, 1400)]
    opts = dict(max_model_len=1536, sparse_policy=policy, sparse_token_budget=64, sparse_sink_tokens=16,
                sparse_recent_tokens=32)
    with build_llm(qwen3_dir, **opts) as gpu:
        ref = generate_with_logits(gpu, prompts, 8)
        assert gpu.get_sparse_stats()["decode"]["density"] < 0.2
    with build_llm(qwen3_dir, enable_cpu_offload=True, num_kvcache_blocks=6, num_ring_slots=2,
                   num_cpu_kvcache_blocks=16, **opts) as tiered:
        got = generate_with_logits(tiered, prompts, 8)
        assert tiered.get_kv_cache_stats()["spilled_blocks"] > 0
    assert got[0] == ref[0] and all((a - b).abs().max() <= 1e-5 for a, b in zip(got[1], ref[1]))

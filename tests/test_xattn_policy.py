"""XATTN_BSA policy (XAttention block-sparse prefill): threshold 1.0 equals FULL with the host
tier on (blocks spilled and gathered back) and GPU-only, a lower threshold skips work and gives
the same masks in both, the policy's mask attends exactly to what it keeps, its statistics, and the
configuration errors (tiny random models, CPU, float32)."""
import pytest
import torch

from _util import build_llm, generate_with_logits, greedy, random_prompt, run_requests
from nanovllm.ops.block_sparse_attention import block_sparse_attention_ref
from nanovllm.sparse import XAttentionBSAPolicy

PROMPT_LENS = (100, 255, 256, 257, 700, 1300)
COMMON = dict(max_model_len=1536, num_kvcache_blocks=24)
TIERED = dict(max_model_len=1536, num_kvcache_blocks=4, enable_cpu_offload=True, num_cpu_kvcache_blocks=24,
              max_num_batched_tokens=512)  # chunks whose prefixes have host blocks
MAX_TOKENS = 24


def _run(model_dir, prompts, **kwargs):
    llm = build_llm(model_dir, **{**COMMON, **kwargs})
    tokens, logits = generate_with_logits(llm, prompts, MAX_TOKENS)
    stats = llm.get_sparse_stats()
    llm.shutdown()
    return tokens, logits, stats


def _assert_same(got, ref):
    tokens, logits, _ = got
    assert tokens == ref[0]
    for n, ours, theirs in zip(PROMPT_LENS, logits, ref[1]):
        assert (ours - theirs).abs().max().item() <= 1e-5, f"prompt of {n} tokens"


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, seed=n) for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def full_tiered(qwen3_dir, prompts):
    return _run(qwen3_dir, prompts, num_ring_slots=2, **TIERED)


@pytest.mark.parametrize("slots", [2, 4])
def test_threshold_one_equals_full_with_spilled_blocks(qwen3_dir, prompts, full_tiered, slots):
    got = _run(qwen3_dir, prompts, sparse_policy="XATTN_BSA", sparse_threshold=1.0, num_ring_slots=slots, **TIERED)
    _assert_same(got, full_tiered)
    prefill = got[2]["prefill"]
    assert prefill["density"] == 1.0 and prefill["kept_blocks"] == prefill["visible_blocks"] > 0
    assert prefill["comm_density"] == 1.0 and prefill["available_host_bytes"] > 0
    assert got[2]["decode"]["comm_density"] == 1.0, "decode is full attention"


def test_threshold_one_equals_full_gpu_only(qwen3_dir, prompts):
    """The non-offload runner path, with a cached prefix and chunked prefill (keys of earlier
    tokens read through the block table)."""
    ref = _run(qwen3_dir, prompts)
    got = _run(qwen3_dir, prompts, sparse_policy="XATTN_BSA", sparse_threshold=1.0)
    _assert_same(got, ref)
    assert got[2]["prefill"]["density"] == 1.0 and got[2]["prefill"]["comm_density"] is None
    shared = random_prompt(600, seed=1)
    follow_ups = [shared + random_prompt(n, seed=n + 1) for n in (300, 700)]
    outputs = {}
    for policy in ("FULL", "XATTN_BSA"):
        # sparse_threshold is XATTN_BSA's option: FULL refuses it (it was silently ignored before)
        options = dict(sparse_threshold=1.0) if policy == "XATTN_BSA" else {}
        llm = build_llm(qwen3_dir, **COMMON, max_num_batched_tokens=512, sparse_policy=policy, **options)
        run_requests(llm, [shared], greedy(4))
        done = run_requests(llm, follow_ups, greedy(MAX_TOKENS))
        assert all(d["seq"].num_cached_tokens >= 512 for d in done.values()), "the prefix cache was not hit"
        outputs[policy] = [d["token_ids"] for d in done.values()]
        llm.shutdown()
    assert outputs["XATTN_BSA"] == outputs["FULL"]


def test_lower_threshold_is_sparse_in_both_modes(qwen3_dir, prompts):
    # one sequence at a time, 512-token chunks in both: the same chunks, so the same estimates
    sparse = dict(sparse_policy="XATTN_BSA", sparse_threshold=0.5, max_num_seqs=1)
    tiered = _run(qwen3_dir, prompts, num_ring_slots=2, **sparse, **TIERED)
    gpu_only = _run(qwen3_dir, prompts, max_num_batched_tokens=512, **sparse)
    for stats in (tiered[2], gpu_only[2]):
        assert 0.0 < stats["prefill"]["density"] < 1.0
        assert stats["prefill"]["kept_blocks"] < stats["prefill"]["visible_blocks"]
        assert all(0.0 < row["density"] <= 1.0 for row in stats["prefill"]["per_layer"])
    # One estimate over the same context, gathered from one tier or two: the same masks and tokens.
    assert tiered[2]["prefill"]["comm_density"] == 1.0 and gpu_only[2]["prefill"]["comm_density"] is None
    assert tiered[2]["prefill"]["kept_blocks"] == gpu_only[2]["prefill"]["kept_blocks"]
    assert tiered[0] == gpu_only[0]


@pytest.mark.slow
def test_tensor_parallel_masks_like_tp1(qwen3_dir, prompts):
    """Estimation and selection are per head, so each rank's share of the heads gets TP=1's
    masks: TP=2 gives TP=1's sparse tokens, with the host tier and GPU-only."""
    sparse = dict(sparse_policy="XATTN_BSA", sparse_threshold=0.5)
    for mode in (dict(num_ring_slots=2, **TIERED), {}):
        tp1 = _run(qwen3_dir, prompts, **sparse, **mode)
        with build_llm(qwen3_dir, **{**COMMON, **sparse, **mode}, tensor_parallel_size=2) as tp2:
            tokens = [o["token_ids"] for o in tp2.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)]
        assert 0.0 < tp1[2]["prefill"]["density"] < 1.0
        assert tokens == tp1[0]


# ---------------------------------------------------------------- the policy, unit level
HEADS_Q, HEADS_KV, DIM, BLOCK = 4, 2, 32, 256


def _steered_inputs(seed=0):
    """Queries along one direction u; keys 256..511 point away from u, 512..767 towards it,
    the rest are noise: the keys 256..511 carry no attention mass."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(DIM, generator=gen), dim=0)
    noise = lambda *shape: 0.3 * torch.randn(*shape, generator=gen)  # noqa: E731
    k = torch.cat([noise(BLOCK, HEADS_KV, DIM), -6 * u + noise(BLOCK, HEADS_KV, DIM),
                   6 * u + noise(BLOCK, HEADS_KV, DIM), noise(BLOCK, HEADS_KV, DIM)])
    v = torch.randn(4 * BLOCK, HEADS_KV, DIM, generator=gen)
    q = 6 * u + noise(BLOCK, HEADS_Q, DIM)  # the last 256 positions
    return q, k, v


def test_mask_skips_blocks_without_mass_and_attends_exactly_to_what_it_keeps():
    q, k, v = _steered_inputs()
    policy = XAttentionBSAPolicy(DIM**-0.5, threshold=0.9)
    mask = policy.prefill_mask(q, k)
    assert mask.shape == (HEADS_Q, 2, 8)
    assert not mask[:, :, 2:4].any(), "the keys pointing away from the queries are dropped"
    assert mask[:, :, 0].all(), "the sink block is kept"
    assert mask[:, 1, 7].all() and mask[:, 0, 6].all(), "the diagonal blocks are kept"
    out, _ = block_sparse_attention_ref(q, k, v, mask, 128, DIM**-0.5, causal=True)
    dense = block_sparse_attention_ref(q, k, v, torch.ones_like(mask), 128, DIM**-0.5, causal=True)[0]
    assert (out - dense).abs().max() < 0.1, "the dropped keys carried (almost) no attention mass"


def test_short_context_is_dense():
    q, k, _ = _steered_inputs()
    assert XAttentionBSAPolicy(DIM**-0.5, threshold=0.1, block_size=256).prefill_mask(q[:100], k[:300]) is None
    assert XAttentionBSAPolicy(DIM**-0.5, threshold=0.1).prefill_mask(q[:10], k[:255]) is None


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sparse_threshold=1.5), r"sparse_threshold must be in \[0, 1\], got 1.5"),
        (dict(sparse_threshold=float("nan")), r"sparse_threshold must be in \[0, 1\], got nan"),
        (dict(sparse_threshold="high"), r"sparse_threshold must be in \[0, 1\], got 'high'"),
        (dict(sparse_stride=6), r"sparse_stride must be a power of two in \[1, 64\], got 6"),
        (dict(sparse_stride=128), r"sparse_stride must be a power of two in \[1, 64\], got 128"),
        (dict(sparse_block_size=96), r"sparse_block_size must be a power of two in \[16, 1024\], got 96"),
        (dict(sparse_block_size=8), r"sparse_block_size must be a power of two in \[16, 1024\], got 8"),
        (dict(sparse_block_size=32, sparse_stride=64), "sparse_stride=64 must be <= sparse_block_size=32"),
        (dict(sparse_chunk_size=100), "sparse_chunk_size must be a positive multiple of sparse_block_size=128, "
                                      "got 100"),
        (dict(sparse_chunk_size=0), "sparse_chunk_size must be a positive multiple of sparse_block_size=128, got 0"),
    ],
)
def test_bad_config_names_field_and_limit(qwen3_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_llm(qwen3_dir, sparse_policy="XATTN_BSA", **kwargs)


def test_policy_checks_its_arguments():
    with pytest.raises(ValueError, match="sparse_threshold"):
        XAttentionBSAPolicy(0.1, threshold=-0.1)
    with pytest.raises(ValueError, match="sparse_chunk_size"):
        XAttentionBSAPolicy(0.1, block_size=64, chunk_size=96)

"""XATTN_BSA policy (XAttention block-sparse prefill): threshold 1.0 equals FULL in offload and
GPU-only mode, the offload estimation streamed in two key-only passes equals the whole-sequence
reference, a lower threshold skips work and attends exactly to what its mask keeps, its
statistics, and the configuration errors (tiny random models, CPU, float32)."""
import pytest
import torch

from _util import build_llm, generate_with_logits, greedy, random_prompt, run_requests
from nanovllm.kvcache.offload_engine import OffloadEngine
from nanovllm.kvcache.sparse import PolicyContext, XAttentionBSAPolicy
from nanovllm.ops.block_sparse_attention import block_sparse_attention_ref
from nanovllm.ops.xattn_estimate import xattn_block_scores_ref

PROMPT_LENS = (100, 255, 256, 257, 700, 1300)
COMMON = dict(max_model_len=1536, num_kvcache_blocks=24)
OFFLOAD = dict(enable_cpu_offload=True, num_cpu_kvcache_blocks=24)
MAX_TOKENS = 24


def _run(model_dir, prompts, **kwargs):
    llm = build_llm(model_dir, **COMMON, **kwargs)
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
def full_offload(qwen3_dir, prompts):
    return _run(qwen3_dir, prompts, num_gpu_blocks=2, **OFFLOAD)


@pytest.mark.parametrize("slots", [2, 4])
def test_threshold_one_equals_full_offload(qwen3_dir, prompts, full_offload, slots):
    got = _run(qwen3_dir, prompts, sparse_policy="XATTN_BSA", sparse_threshold=1.0, num_gpu_blocks=slots, **OFFLOAD)
    _assert_same(got, full_offload)
    prefill = got[2]["prefill"]
    assert prefill["density"] == 1.0 and prefill["kept_blocks"] == prefill["visible_blocks"] > 0
    assert prefill["comm_density"] == 1.0
    assert prefill["estimate_k_loads"] == 2 * prefill["available_cpu_blocks"] > 0
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
        llm = build_llm(qwen3_dir, **COMMON, max_num_batched_tokens=512, sparse_policy=policy,
                        sparse_threshold=1.0)
        run_requests(llm, [shared], greedy(4))
        done = run_requests(llm, follow_ups, greedy(MAX_TOKENS))
        assert all(d["seq"].num_cached_tokens >= 512 for d in done.values()), "the prefix cache was not hit"
        outputs[policy] = [d["token_ids"] for d in done.values()]
        llm.shutdown()
    assert outputs["XATTN_BSA"] == outputs["FULL"]


def test_lower_threshold_is_sparse_in_both_modes(qwen3_dir, prompts):
    offload = _run(qwen3_dir, prompts, sparse_policy="XATTN_BSA", sparse_threshold=0.5, num_gpu_blocks=2, **OFFLOAD)
    gpu_only = _run(qwen3_dir, prompts, sparse_policy="XATTN_BSA", sparse_threshold=0.5)
    for stats in (offload[2], gpu_only[2]):
        assert 0.0 < stats["prefill"]["density"] < 1.0
        assert stats["prefill"]["kept_blocks"] < stats["prefill"]["visible_blocks"]
        assert all(0.0 < row["density"] <= 1.0 for row in stats["prefill"]["per_layer"])
    # One estimate, two ways of streaming it: the same masks, so the same densities and tokens.
    assert offload[2]["prefill"]["kept_blocks"] == gpu_only[2]["prefill"]["kept_blocks"]
    assert offload[0] == gpu_only[0]


@pytest.mark.slow
def test_tensor_parallel_masks_like_tp1(qwen3_dir, prompts):
    """Estimation and selection are per head, so each rank's share of the heads gets TP=1's
    masks: TP=2 gives TP=1's sparse tokens, offload and GPU-only."""
    sparse = dict(sparse_policy="XATTN_BSA", sparse_threshold=0.5)
    for mode in (dict(num_gpu_blocks=2, **OFFLOAD), {}):
        tp1 = _run(qwen3_dir, prompts, **sparse, **mode)
        with build_llm(qwen3_dir, **COMMON, **sparse, **mode, tensor_parallel_size=2) as tp2:
            tokens = [o["token_ids"] for o in tp2.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)]
        assert 0.0 < tp1[2]["prefill"]["density"] < 1.0
        assert tokens == tp1[0]


# ---------------------------------------------------------------- the offload policy, unit level
BLOCK, HEADS_Q, HEADS_KV, DIM = 256, 4, 2, 32


def _engine(num_cpu_blocks=4, slots=2):
    return OffloadEngine(1, HEADS_KV, DIM, torch.float32, torch.device("cpu"), BLOCK, num_cpu_blocks, slots, 1)


def test_two_pass_estimation_equals_whole_reference():
    gen = torch.Generator().manual_seed(0)
    engine = _engine()
    engine.k_cpu.copy_(torch.randn(engine.k_cpu.shape, generator=gen))
    engine.v_cpu.fill_(float("nan"))  # the estimation must not read values
    q = torch.randn(200, HEADS_Q, DIM, generator=gen)
    k_chunk = torch.randn(200, HEADS_KV, DIM, generator=gen)
    ctx = PolicyContext(0, cpu_blocks=[2, 0, 3], block_lens=[BLOCK] * 3, is_prefill=True, chunk_block=1)
    policy = XAttentionBSAPolicy(DIM**-0.5, threshold=0.9)
    scores = policy.block_scores(q, k_chunk, engine, ctx)
    keys = torch.cat([engine.k_cpu[0, 2], engine.k_cpu[0, 0], engine.k_cpu[0, 3], k_chunk])
    ref = xattn_block_scores_ref(q, keys, 8, 128, DIM**-0.5)
    assert scores.shape == ref.shape == (HEADS_Q, 2, 8)
    assert (scores - ref).abs().max() <= 1e-4
    assert engine.bytes_h2d == 2 * 3 * engine.block_bytes, "two passes over 3 blocks, keys only"


def _steered_inputs(seed=0):
    """Queries along one direction u; host block 1's keys point away from u, block 2's towards
    it, block 0's and the chunk's are noise: block 1 carries no attention mass."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(DIM, generator=gen), dim=0)
    engine = _engine()
    noise = lambda *shape: 0.3 * torch.randn(*shape, generator=gen)  # noqa: E731
    engine.k_cpu[0, 0] = noise(BLOCK, HEADS_KV, DIM)
    engine.k_cpu[0, 1] = -6 * u + noise(BLOCK, HEADS_KV, DIM)
    engine.k_cpu[0, 2] = 6 * u + noise(BLOCK, HEADS_KV, DIM)
    engine.v_cpu.copy_(torch.randn(engine.v_cpu.shape, generator=gen))
    q = 6 * u + noise(BLOCK, HEADS_Q, DIM)
    k, v = noise(BLOCK, HEADS_KV, DIM), torch.randn(BLOCK, HEADS_KV, DIM, generator=gen)
    return engine, q, k, v


def test_sparse_prefill_skips_blocks_and_equals_masked_attention():
    engine, q, k, v = _steered_inputs()
    policy = XAttentionBSAPolicy(DIM**-0.5, threshold=0.9)
    ctx = PolicyContext(0, cpu_blocks=[0, 1, 2], block_lens=[BLOCK] * 3, is_prefill=True, chunk_block=3)
    history_k = torch.cat([engine.k_cpu[0, b] for b in range(3)])
    history_v = torch.cat([engine.v_cpu[0, b] for b in range(3)])
    out = policy.compute_chunked_prefill(q, k, v, engine, ctx)
    mask = ctx.extra["mask"]
    assert ctx.extra["chosen"] == [0, 2], "block 1 carries no mass; block 0 holds the sink"
    assert not mask[:, :, 2:4].any() and mask[:, :, 0].all()
    ref, _ = block_sparse_attention_ref(q, torch.cat([history_k, k]), torch.cat([history_v, v]), mask, 128,
                                        DIM**-0.5, causal=True)
    assert (out - ref).abs().max() <= 1e-5
    stats = policy.sparse_stats()["prefill"]
    assert stats["comm_density"] == pytest.approx(2 / 3)
    assert stats["density"] < 0.7 and stats["kept_blocks"] == int(mask.sum())
    assert stats["visible_blocks"] == HEADS_Q * (7 + 8)  # 2 query blocks over 6 + 1 / 6 + 2 key blocks
    block_bytes = engine.block_bytes
    assert engine.bytes_h2d == 2 * 3 * block_bytes + 2 * 2 * block_bytes, "K twice for 3 blocks, K+V for 2"
    assert engine.bytes_d2h == 2 * block_bytes, "the chunk was offloaded"


def test_short_context_attends_densely():
    engine, q, k, v = _steered_inputs()
    policy = XAttentionBSAPolicy(DIM**-0.5, threshold=0.1, block_size=256)  # 256 tokens < 2 sparse blocks
    ctx = PolicyContext(0, cpu_blocks=[], block_lens=[], is_prefill=True, chunk_block=3)
    out = policy.compute_chunked_prefill(q, k, v, engine, ctx)
    ref, _ = block_sparse_attention_ref(q, k, v, torch.ones(HEADS_Q, 1, 1, dtype=torch.bool), 256, DIM**-0.5)
    assert (out - ref).abs().max() <= 1e-5 and "mask" not in ctx.extra
    assert policy.sparse_stats()["prefill"]["density"] == 1.0


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
        (dict(sparse_block_size=512), "sparse_block_size=512 must divide kvcache_block_size=256"),
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
    with pytest.raises(ValueError, match="sparse_block_size=512 must divide kvcache_block_size=256"):
        XAttentionBSAPolicy(0.1, block_size=512, chunk_size=1024).initialize(_engine())

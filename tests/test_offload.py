"""CPU-offload mode against the GPU-only (paged) engine: identical greedy tokens and logits.

Offload mode keeps every sequence's KV in host blocks and streams them through a ring buffer of
``num_gpu_blocks`` slots; on CPU the same pipeline runs with synchronous copies, so these tests
exercise the whole chunking, ring-slot and decode-buffer logic.
"""
import pytest
import torch

from _util import build_llm, generate_with_logits as _generate, greedy, random_prompt

PROMPT_LENS = (1, 100, 255, 256, 257, 1000, 3000)
MAX_MODEL_LEN = 3100


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, seed=n) for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=[256, 1024])
def reference(request, qwen3_dir, prompts):
    block = request.param
    llm = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, kvcache_block_size=block,
                    num_kvcache_blocks=20480 // block)
    tokens, logits = _generate(llm, prompts, 70)
    llm.shutdown()
    return block, tokens, logits


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_offload_equals_gpu_only(qwen3_dir, prompts, reference, slots):
    block, ref_tokens, ref_logits = reference
    llm = build_llm(qwen3_dir, max_model_len=MAX_MODEL_LEN, kvcache_block_size=block,
                    enable_cpu_offload=True, num_gpu_blocks=slots, num_cpu_kvcache_blocks=20480 // block)
    tokens, logits = _generate(llm, prompts, 70)
    assert tokens == ref_tokens
    for n, ours, ref in zip(PROMPT_LENS, logits, ref_logits):
        assert (ours - ref).abs().max().item() <= 1e-5, f"prompt of {n} tokens"
    again, _ = _generate(llm, prompts[::-1], 70)
    assert again == ref_tokens[::-1], "a second generate on the same engine must give the same tokens"
    assert llm.scheduler.block_manager.num_free_blocks == 20480 // block, "blocks leaked"
    llm.shutdown()


def test_decode_blocks_are_offloaded_and_read_back(llama_tied_dir):
    """600 decode tokens with block 256: two decode buffers fill and go to host blocks, and
    the tokens after that still equal the GPU-only engine's (GQA 3:1, head_dim 64)."""
    prompt = [random_prompt(300, seed=7)]
    ref = build_llm(llama_tied_dir, max_model_len=1024, num_kvcache_blocks=8)
    ref_tokens, ref_logits = _generate(ref, prompt, 600)
    ref.shutdown()
    llm = build_llm(llama_tied_dir, max_model_len=1024, enable_cpu_offload=True, num_gpu_blocks=2,
                    num_cpu_kvcache_blocks=8)
    engine = llm.model_runner.offload_engine
    tokens, logits = _generate(llm, prompt, 600)
    assert tokens == ref_tokens
    assert (logits[0] - ref_logits[0]).abs().max().item() <= 1e-5
    block_bytes = engine.block_bytes * engine.num_layers * 2
    assert engine.bytes_d2h >= 2 * block_bytes, "two full decode blocks went to the host"
    llm.shutdown()


def test_prefill_prefetch_is_taken(llama_tied_dir, monkeypatch):
    """A dense prefill prefetches the next layer's first earlier blocks as soon as a layer is
    done, and that layer takes them: 1,000 tokens in 256-token chunks (4 chunks), 2 slots, each
    earlier block's K and V loaded exactly once per chunk and layer."""
    llm = build_llm(llama_tied_dir, max_model_len=1024, kvcache_block_size=256, enable_cpu_offload=True,
                    num_gpu_blocks=2, num_cpu_kvcache_blocks=4)
    engine = llm.model_runner.offload_engine
    prefetched = []
    prefetch = engine.prefetch_to_slot_layer
    monkeypatch.setattr(engine, "prefetch_to_slot_layer", lambda *a: (prefetched.append(a), prefetch(*a)))
    before = engine.bytes_h2d
    tokens, _ = _generate(llm, [random_prompt(1000, seed=3)], 1)
    layers = engine.num_layers
    assert engine.bytes_h2d - before == layers * (0 + 1 + 2 + 3) * 2 * engine.block_bytes
    assert len(prefetched) == (layers - 1) * (0 + 1 + 2 + 2), "the first min(slots, earlier) blocks of layers 1.."
    assert all(layer >= 1 for _, layer, _ in prefetched)
    llm.shutdown()


def test_offload_errors_name_the_limits(qwen3_dir):
    with pytest.raises(ValueError, match="num_gpu_blocks must be >= 2, got 1"):
        build_llm(qwen3_dir, enable_cpu_offload=True, num_gpu_blocks=1)
    with pytest.raises(RuntimeError, match="cannot hold one sequence of max_model_len=1024"):
        build_llm(qwen3_dir, enable_cpu_offload=True, num_cpu_kvcache_blocks=2)
    with pytest.raises(ValueError, match="sparse_policy must be one of"):
        build_llm(qwen3_dir, enable_cpu_offload=True, sparse_policy="NOPE")
    with pytest.raises(ValueError, match="cpu_memory_utilization must be in"):
        build_llm(qwen3_dir, enable_cpu_offload=True, cpu_memory_utilization=0)


@pytest.mark.slow
def test_offload_tensor_parallel_2_equals_1(llama_tied_dir):
    """Each gloo rank offloads its own KV-head shard; TP=2 gives TP=1's offload tokens,
    through chunked prefill and a decode block that fills and moves to the host."""
    prompts = [random_prompt(n, seed=290 + n) for n in (40, 700)]
    opts = dict(max_model_len=1024, enable_cpu_offload=True, num_gpu_blocks=2, num_cpu_kvcache_blocks=8)
    with build_llm(llama_tied_dir, **opts) as tp1:
        ref, _ = _generate(tp1, prompts, 300)
    with build_llm(llama_tied_dir, tensor_parallel_size=2, **opts) as tp2:
        cpu_blocks = tp2.model_runner.num_kv_blocks
        tokens = [o["token_ids"] for o in tp2.generate(prompts, greedy(300), use_tqdm=False)]
    assert tokens == ref
    assert cpu_blocks == 8

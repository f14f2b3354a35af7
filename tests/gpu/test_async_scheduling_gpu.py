"""Async scheduling on CUDA with CUDA graphs (run on the H200: ``python -m pytest
tests/gpu/test_async_scheduling_gpu.py -m gpu``): the same batches with ``async_scheduling`` on
(the CUDA default) and off give the same RequestOutputs and the same KV block traffic.

Where every request ends on its length (nothing stops on a sampled token) the steps have the same
shapes and the outputs must be equal to the bit (bf16). Where requests stop on sampled tokens,
the stopping sequence is computed in one more step, which can change that step's CUDA-graph batch
size; there (float32) tokens, text and finish reasons must be equal, logprobs within
``FLOAT32_TOL`` and each sampled token's rank within ``RANK_TOL`` (the rank counts the vocabulary's
logits above the token's: deep in a random model's nearly flat distribution, float32 logits of two
batch shapes reorder near-ties; seen on the H200: 134,497 against 134,496). Each run's wall time
goes to ``$OUT/async_scheduling_gpu.json`` when $OUT is set.
"""
import dataclasses
import gc
import json
import os
import random
import time

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tools.random_checkpoint import make_random_checkpoint

from _util import assert_same

pytestmark = pytest.mark.gpu

FLOAT32_TOL = 1e-3
RANK_TOL = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_checkpoint("qwen3-0.6b", str(tmp_path_factory.mktemp("gpu") / "qwen3-4l"), num_hidden_layers=4)


def _workload(num: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 30000) for _ in range(rng.randint(50, 700))] for _ in range(num)]
    kinds = [
        lambda m: SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True),
        lambda m: SamplingParams(temperature=0.6, seed=rng.randrange(1000), max_tokens=m, ignore_eos=True, logprobs=5),
        lambda m: SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, presence_penalty=0.5,
                                 frequency_penalty=0.2, repetition_penalty=1.1, logprobs=1),
        lambda m: SamplingParams(temperature=0.8, seed=rng.randrange(1000), n=2, top_p=0.9, top_k=40,
                                 max_tokens=m, ignore_eos=True, min_tokens=m // 2),
    ]
    return prompts, [kinds[i % len(kinds)](rng.randint(20, 200)) for i in range(num)]


def _run(model_dir, prompts, params, dtype: str, async_scheduling: bool, **engine):
    with LLM(model_dir, **{**dict(dtype=dtype, device="cuda", max_model_len=2048, max_num_seqs=64,
                                  gpu_memory_utilization=0.5, async_scheduling=async_scheduling), **engine}) as llm:
        assert llm.config.async_scheduling is async_scheduling and llm.model_runner.graphs is not None
        ahead, run = [0], llm.model_runner.run

        def counting_run(seqs, is_prefill, generators=None, spills=(), input_ids=None):
            ahead[0] += input_ids is not None
            return run(seqs, is_prefill, generators, spills, input_ids)

        llm.model_runner.run = counting_run
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        stats = llm.get_kv_cache_stats()
        stats.pop("host_bytes_pinned", None)  # pinned ahead of need: timing, not traffic
        stats["sparse_decode"] = llm.get_sparse_stats()["decode"]
        # the tiers' sizes come from the free memory at start-up, which the previous engine's
        # leftovers change (17,631 vs 17,521 blocks on the H200): compare the traffic only
        for capacity in ("gpu_blocks", "host_blocks", "gpu_tokens", "host_tokens"):
            stats.pop(capacity, None)
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.gpu.num_blocks + (bm.host.num_blocks if llm.config.enable_cpu_offload else 0)
    gc.collect()
    torch.cuda.empty_cache()
    return [{k: v for k, v in dataclasses.asdict(o).items() if k not in ("request_id", "metrics")}
            for o in outputs], \
        stats, ahead[0], seconds


def _pop_sampled_ranks(outputs) -> list[int]:
    """Remove the rank of each sampled token (the first entry of each logprobs position) from
    ``outputs`` (asdict form) and return them in order."""
    return [next(iter(entry.values())).pop("rank") for o in outputs for c in o["outputs"]
            for entry in c["logprobs"] or []]


def _report(name: str, **values):
    print(json.dumps({"test": name, **values}))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "async_scheduling_gpu.json"), "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


def test_length_stops_are_bit_identical(model_dir):
    prompts, params = _workload(96, seed=0)
    on, on_stats, ahead, on_s = _run(model_dir, prompts, params, "bfloat16", True)
    off, off_stats, none_ahead, off_s = _run(model_dir, prompts, params, "bfloat16", False)
    _report("length_stops", seconds_async=round(on_s, 3), seconds_sync=round(off_s, 3), steps_ahead=ahead)
    assert ahead > 0 and none_ahead == 0
    assert on == off
    assert on_stats == off_stats


def test_token_stops_match(model_dir):
    """Stop token ids, stop strings and eos taken from a first run, so requests stop mid-way."""
    prompts, params = _workload(64, seed=1)
    free, _, _, _ = _run(model_dir, prompts, params, "float32", False)
    stopping = []
    for i, (sp, out) in enumerate(zip(params, free)):
        tokens, text = out["outputs"][0]["token_ids"], out["outputs"][0]["text"]
        change = {"ignore_eos": False}
        if i % 3 == 0:
            change["stop_token_ids"] = [tokens[len(tokens) // 3]]
        elif i % 3 == 1 and len(text) > 8:
            change["stop"] = [text[len(text) // 2:len(text) // 2 + 4]]
        stopping.append(dataclasses.replace(sp, **change))
    on, on_stats, ahead, on_s = _run(model_dir, prompts, stopping, "float32", True)
    off, off_stats, _, off_s = _run(model_dir, prompts, stopping, "float32", False)
    reasons = [c["finish_reason"] for o in off for c in o["outputs"]]
    _report("token_stops", seconds_async=round(on_s, 3), seconds_sync=round(off_s, 3), steps_ahead=ahead,
            stopped=reasons.count("stop"), requests=len(reasons))
    assert ahead > 0 and reasons.count("stop") > len(reasons) // 4
    on_ranks, off_ranks = _pop_sampled_ranks(on), _pop_sampled_ranks(off)
    assert len(on_ranks) == len(off_ranks) and all(abs(a - b) <= RANK_TOL for a, b in zip(on_ranks, off_ranks))
    assert_same(on, off, FLOAT32_TOL)
    assert on_stats == off_stats


@pytest.mark.parametrize("host", [False, True])
def test_quest_steps_ahead_are_bit_identical(model_dir, host):
    """QUEST choosing pages per KV head (a 128-token budget: decode reads a fraction of each
    context), GPU-only and over the host tier (a GPU tier of 16 blocks for 48 sequences: spills and
    page gathers through the reuse cache while steps run ahead): the async loop's outputs and KV and
    sparse statistics equal the synchronous loop's, to the bit (bf16, every request ends on its
    length)."""
    prompts, params = _workload(48, seed=2)
    params = [dataclasses.replace(sp, max_tokens=min(sp.max_tokens, 64), min_tokens=min(sp.min_tokens, 64))
              for sp in params]
    engine = dict(sparse_policy="QUEST", sparse_token_budget=128, sparse_recent_tokens=64, kvcache_block_size=256)
    if host:
        engine.update(enable_cpu_offload=True, num_kvcache_blocks=16, num_cpu_kvcache_blocks=512)
    on, on_stats, ahead, on_s = _run(model_dir, prompts, params, "bfloat16", True, **engine)
    off, off_stats, none_ahead, off_s = _run(model_dir, prompts, params, "bfloat16", False, **engine)
    _report(f"quest{'_host' if host else ''}", seconds_async=round(on_s, 3), seconds_sync=round(off_s, 3),
            steps_ahead=ahead, decode_density=off_stats["sparse_decode"]["density"])
    assert ahead > 0 and none_ahead == 0
    assert off_stats["sparse_decode"]["density"] < 1
    if host:
        assert off_stats["spilled_blocks"] > 0
    assert on == off
    assert on_stats == off_stats


def test_default_is_on_for_cuda(model_dir):
    with LLM(model_dir, device="cuda", max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.3) as llm:
        assert llm.config.async_scheduling is True
    with LLM(model_dir, device="cuda", max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.3,
             sparse_policy="QUEST") as llm:
        assert llm.config.async_scheduling is True

"""The two-tier KV cache on the GPU: random-weight Llama-3.1-8B shape (32 layers).

The host tier is on and the GPU tier forced to its smallest useful size (4 blocks of 1,024
tokens, 2 of 4,096: an 8K prompt fills 3 of 4,096), so all but each sequence's first block and
the block it writes live on the host (prefill gathers them, decode streams them through the
ring). Greedy tokens must equal GPU-only mode for 64 decode steps after prompts of about 8K, 32K
and 128K tokens whose lengths are not block multiples: in float32 (8K and 32K; 128K with 2 ring
slots of 1,024 tokens, 125 ring blocks per layer and step), where the decode orders (one paged pass
vs paged + ring blocks merged by LSE) differ by ~1e-6 and any differing token is a bug; in
bfloat16 a parting must be a near-tie: its candidates' teacher-forced logits closer than bf16 noise
measured at that length (the GPU-only run's decode logprobs against the teacher-forced forward of
the same tokens, ``tools.divergence.decode_noise``; at least ``NEAR_TIE``). 20 repeated 32K runs
(16 decode steps) with 2 slots must all be identical. Slow; run it on the device:

    python -m pytest tests/gpu/test_tiers_gpu.py -q
"""
import gc

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tools.divergence import decode_noise, parting
from tools.random_checkpoint import cached_random_checkpoint

pytestmark = pytest.mark.gpu

LENGTHS = {"8k": 8192 + 123, "32k": 32768 - 77, "128k": 131072 - 1100}
DECODE_STEPS = 64
MAX_MODEL_LEN = 131072
REPEATS = 20
REPEAT_STEPS = 16


def _prompt(length: int) -> list[int]:
    g = torch.Generator().manual_seed(length)
    return torch.randint(1, 30000, (length,), generator=g).tolist()


def _greedy(llm: LLM, prompt: list[int], steps: int = DECODE_STEPS, logprobs: int | None = None):
    """The greedy tokens; with ``logprobs``, ``(tokens, per-step top-logprobs)``."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=logprobs)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids) if logprobs is None else (list(out.token_ids), out.logprobs)


@pytest.fixture(scope="module")
def model_dir():
    return cached_random_checkpoint("llama-3.1-8b")


_references: dict = {}


def _reference(request, model_dir, dtype: str, length: str) -> tuple[list[int], list[dict]]:
    """GPU-only greedy tokens of prompt ``length`` and their top-5 logprobs, run alone (computed
    once per dtype and length; one GPU-only engine computes every length of ``dtype`` that the
    selected cases need)."""
    if (dtype, length) not in _references:
        _release_engines()
        selected = [item.callspec.params for item in request.session.items
                    if item.module is request.module and hasattr(item, "callspec")]
        names = [length] + [p["length"] for p in selected if p["dtype"] == dtype]
        with LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=1, dtype=dtype) as llm:
            for name in dict.fromkeys(n for n in names if (dtype, n) not in _references):
                _references[dtype, name] = _greedy(llm, _prompt(LENGTHS[name]), logprobs=5)
        gc.collect()
        torch.cuda.empty_cache()
    return _references[dtype, length]


_engines: dict = {}


def _release_engines():
    for llm in _engines.values():
        llm.shutdown()
    _engines.clear()
    gc.collect()
    torch.cuda.empty_cache()


NEAR_TIE = 0.1
"""bf16: a parting's two candidates' float32 logits may always be this close (the limit is the
larger of this and the noise measured at the prompt's length)."""


GPU_BLOCKS = {1024: 4, 4096: 2}
"""GPU-tier blocks per block size: few enough that every prompt here spills."""


def _tiered_llm(model_dir, slots: int, block: int, dtype: str = "bfloat16") -> LLM:
    """One tiered engine at a time (the previous one is shut down first), GPU tier of
    ``GPU_BLOCKS[block]`` blocks."""
    key = (slots, block, dtype)
    if key not in _engines:
        _release_engines()
        _engines[key] = LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=1, enable_cpu_offload=True,
                            num_ring_slots=slots, kvcache_block_size=block, dtype=dtype,
                            num_kvcache_blocks=GPU_BLOCKS[block],
                            num_cpu_kvcache_blocks=-(-MAX_MODEL_LEN // block))
    return _engines[key]


CASES = [(dtype, slots, block, length) for dtype in ("float32", "bfloat16") for slots in (2, 4)
         for block in (1024, 4096) for length in LENGTHS
         if dtype == "bfloat16" or length != "128k" or (slots, block) == (2, 1024)]
"""Grouped by dtype and engine configuration, so each engine is built once. float32 at 128K (minutes
per engine) runs in the configuration with the most ring blocks and the fewest slots."""


@pytest.mark.parametrize("dtype,slots,block,length", CASES)
def test_tiered_tokens_equal_gpu_only(request, model_dir, dtype, slots, block, length):
    reference, logprobs = _reference(request, model_dir, dtype, length)
    llm = _tiered_llm(model_dir, slots, block, dtype)
    prompt = _prompt(LENGTHS[length])
    tokens = _greedy(llm, prompt)
    assert llm.get_kv_cache_stats()["spilled_blocks"] > 0
    if tokens == reference:
        return
    p = parting(llm, prompt, reference, tokens)
    noise = decode_noise(llm, prompt, reference, logprobs)
    report = (f"first differing decode step {p['step']}: tiered {p['theirs']} (logit {p['logit_theirs']:.4f}, "
              f"{p['theirs_rank']} above it), GPU-only {p['ours']} (logit {p['logit_ours']:.4f}); "
              f"top-2 logits {p['top2']}; {dtype} noise at this length {noise:.4f}")
    assert dtype == "bfloat16", report
    assert abs(p["logit_gap"]) < max(NEAR_TIE, noise), report


def test_repeated_32k_runs_are_identical(model_dir):
    llm = _tiered_llm(model_dir, 2, 4096)
    runs = [_greedy(llm, _prompt(LENGTHS["32k"]), REPEAT_STEPS) for _ in range(REPEATS)]
    assert all(run == runs[0] for run in runs)

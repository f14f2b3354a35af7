"""Tensor parallelism over NCCL on two GPUs: TP=2 gives TP=1's greedy tokens (CUDA graphs on),
in GPU-only and offload mode and under torchrun. Runs on the 2-GPU machine (nvidia-h200-x2):
``python -m pytest tests/gpu/test_tp_gpu.py``; a report per test goes to ``$OUT/tp_*.json``.

The models run in float32. TP changes the order of floating-point sums (each rank's GEMM sums
half of the hidden features; column-split GEMMs may pick other cuBLAS kernels), so in bfloat16
a near-tie between two candidates can go either way and the sequences part from there:
``benchmarks/tp_agreement.py`` measures where, and how close the tie was. In float32 those
differences are ~1e-6 relative, far below the gaps between candidates, so any differing token
is a TP bug (a wrong shard, a missed all-reduce), which is what these tests look for."""
import json
import os

import pytest
import torch

from _util import run_torchrun
from nanovllm import LLM, SamplingParams
from tools.divergence import first_difference
from tools.random_checkpoint import cached_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

NUM_PROMPTS, MAX_TOKENS = 8, 64
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
DTYPE = "float32"


def _checkpoint(shape: str) -> str:
    return cached_random_checkpoint(shape)


@pytest.fixture(scope="module", params=["qwen3-0.6b", "llama-3.1-8b"])
def model_dir(request):
    return _checkpoint(request.param)


def _prompts(n: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(1, 32000, (length,), generator=g).tolist() for length in lengths]


def _generate(model_dir: str, prompts, **kwargs) -> list[list[int]]:
    with LLM(model_dir, **kwargs) as llm:
        assert (llm.model_runner.graphs is not None) == (not kwargs.get("enforce_eager"))
        outputs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    return [o["token_ids"] for o in outputs]


def _report(name: str, model_dir: str, prompts, tp1, tp2) -> dict:
    """First differing step per prompt (None when equal), written to $OUT/tp_<name>.json."""
    first = [first_difference(x, y) for x, y in zip(tp1, tp2)]
    report = {"test": name, "model": os.path.basename(model_dir), "prompts": len(prompts),
              "prompt_lens": [len(p) for p in prompts], "max_tokens": MAX_TOKENS,
              "identical": tp1 == tp2, "first_difference": first}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"tp_{name}.json"), "w") as f:
            json.dump(report, f)
    return report


def test_tp2_greedy_equals_tp1(model_dir):
    prompts = _prompts(NUM_PROMPTS, 64, 1024)
    opts = dict(max_model_len=2048, max_num_seqs=64, dtype=DTYPE)
    tp1 = _generate(model_dir, prompts, **opts)
    tp2 = _generate(model_dir, prompts, tensor_parallel_size=2, **opts)
    report = _report(f"greedy_{os.path.basename(model_dir)}", model_dir, prompts, tp1, tp2)
    assert tp1 == tp2, report


def test_tp2_offload_32k_equals_tp1():
    """Each rank keeps its KV-head shard (4 of Llama-3.1-8B's 8 KV heads) in both tiers at 32K,
    with the GPU tier forced to half of the KV."""
    model_dir = _checkpoint("llama-3.1-8b")
    prompts = _prompts(1, 32768, 32768, seed=1)
    block = 4096
    opts = dict(max_model_len=32768 + MAX_TOKENS + 1, kvcache_block_size=block, max_num_seqs=1,
                dtype=DTYPE, enable_cpu_offload=True, num_ring_slots=4, num_kvcache_blocks=4, num_cpu_kvcache_blocks=9)
    tp1 = _generate(model_dir, prompts, **opts)
    tp2 = _generate(model_dir, prompts, tensor_parallel_size=2, **opts)
    report = _report("offload_32k", model_dir, prompts, tp1, tp2)
    assert tp1 == tp2, report


def test_torchrun_tp2_equals_tp1(tmp_path):
    """env:// rendezvous under torchrun, one process per GPU; both ranks return TP=1's tokens."""
    model_dir = _checkpoint("qwen3-0.6b")
    prompts = _prompts(NUM_PROMPTS, 64, 1024, seed=2)
    opts = dict(max_model_len=2048, max_num_seqs=64, dtype=DTYPE)
    tp1 = _generate(model_dir, prompts, **opts)
    spec = dict(model=model_dir, llm=opts, prompts=prompts, params=[GREEDY] * NUM_PROMPTS)
    (rank0,), (rank1,) = run_torchrun(spec, tmp_path)
    report = _report("torchrun", model_dir, prompts, tp1, rank0)
    assert rank0 == rank1
    assert tp1 == rank0, report

"""Benchmark of the Sampler on CUDA: the fused path (one Triton kernel, nanovllm.ops.sample_race)
against today's torch path, at batch 1 / 64 / 256 over Qwen3's 151,936-token vocabulary, bfloat16
logits; all rows sampled at temperature 0.6 (bench.py's workload), and all rows greedy. Prints one
JSON document: median milliseconds per Sampler call (triton.testing.do_bench: host launch work
included where it exceeds the GPU time), and of the kernel alone.
Usage, from the repository root: python -m benchmarks.bench_sampler
"""

import json

import torch
from triton.testing import do_bench

from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.ops import sample_race

VOCAB = 151_936
BATCHES = (1, 64, 256)
TEMPERATURE = 0.6


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench(batch: int, temperature: float) -> dict:
    logits = torch.randn(batch, VOCAB, device="cuda").mul_(3).bfloat16()
    generator = torch.Generator("cuda").manual_seed(0)
    sampled = temperature > 0
    temperatures = torch.full((batch,), temperature if sampled else 1.0, device="cuda")
    params = SamplingTensors(temperatures if sampled else None, None, None, None,
                             sampled_rows=list(range(batch)) if sampled else [], generators={})
    fused, torch_path = Sampler(fused=True), Sampler(fused=False)
    seeds = torch.randint(2**62, (batch,), device="cuda")
    fused_ms = _ms(lambda: fused(logits, params, generator))
    torch_ms = _ms(lambda: torch_path(logits, params, generator))
    kernel_ms = _ms(lambda: sample_race(logits, temperatures if sampled else None, seeds))
    return {"batch": batch, "vocab": VOCAB, "dtype": "bfloat16", "temperature": temperature,
            "fused_ms": fused_ms, "torch_ms": torch_ms, "speedup": torch_ms / fused_ms, "kernel_ms": kernel_ms,
            "kernel_logits_read_gbps": logits.numel() * logits.element_size() / (kernel_ms * 1e-3) / 1e9}


def main() -> None:
    results = [bench(batch, temperature) for temperature in (TEMPERATURE, 0.0) for batch in BATCHES]
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sampler": results},
                     indent=1))


if __name__ == "__main__":
    main()

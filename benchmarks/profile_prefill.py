"""Kernel time of one long prefill by category, GPU-only vs the host tier; prints one JSON line per mode.

Random-weight Llama-3.1-8B shape (bench_offload.py's checkpoint), bf16, 4,096-token blocks,
16,384-token chunks. The tiered mode forces the GPU tier to 4 blocks, so each chunk gathers its
prefix's host blocks (H2D copies on the compute stream). Under
torch.profiler, each kernel's device time is summed into a category (GEMM, attention, merge,
memcpy, norm/RoPE, other) and the 25 largest entries are listed, beside the wall-clock TTFT:
TTFT minus the compute kernels' sum is time the compute stream waited (copies run on their own
engines). Usage: python -m benchmarks.profile_prefill [input_len, default 32768]
"""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams
from tools.random_checkpoint import cached_random_checkpoint

BLOCK = 4096
CATEGORIES = (("gemm", ("gemm", "nvjet", "xmma", "cutlass")), ("attention", ("cudnn", "fmha", "flash", "attn")),
              ("merge", ("merge",)), ("memcpy", ("memcpy",)), ("norm_rope", ("rms_norm", "rotary")))


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def profile_prefill(model: str, offload: bool, input_len: int) -> dict:
    kwargs = dict(max_model_len=input_len + 64, kvcache_block_size=BLOCK, max_num_seqs=1, max_num_batched_tokens=16384)
    if offload:
        kwargs.update(enable_cpu_offload=True, num_kvcache_blocks=4, num_cpu_kvcache_blocks=-(-(input_len + 64) // BLOCK))
    llm = LLM(model, **kwargs)
    prompt = torch.randint(1, 30000, (input_len,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([prompt[:BLOCK]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while not llm.scheduler.running:
            llm.step()
        torch.cuda.synchronize()
        ttft = time.perf_counter() - start
    while not llm.is_finished():
        llm.step()
    llm.shutdown()
    totals, kernels = {}, {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.self_device_time_total <= 0:
            continue
        ms = event.self_device_time_total / 1e3
        totals[category(event.key)] = totals.get(category(event.key), 0.0) + ms
        kernels[event.key[:100]] = (round(ms, 1), event.count)
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:25]
    return {"mode": "tiered" if offload else "gpu", "input_len": input_len, "ttft_s": round(ttft, 3),
            "kernel_ms_by_category": {c: round(ms, 1) for c, ms in sorted(totals.items())},
            "top_kernels": [{"kernel": name, "ms": ms, "calls": calls} for name, (ms, calls) in top]}


def main() -> None:
    input_len = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    model = cached_random_checkpoint("llama-3.1-8b")
    for offload in (False, True):
        print(json.dumps(profile_prefill(model, offload, input_len)), flush=True)


if __name__ == "__main__":
    main()

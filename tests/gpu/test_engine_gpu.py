"""Engine checks on a CUDA GPU (run on the H200: ``python -m pytest tests/gpu -m gpu``)."""
import gc
import json
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import make_random_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """Llama-3.1-8B's shape (GQA 4:1, head_dim 128, llama3 RoPE, 128K vocab), 4 layers."""
    path = str(tmp_path_factory.mktemp("gpu") / "llama3-4l")
    return make_random_checkpoint("llama-3.1-8b", path, num_hidden_layers=4)


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 32000, (n, length), generator=g).tolist()


def _hf_top1(path, prompts, dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    with torch.inference_mode():
        top1 = [hf(torch.tensor([p], device="cuda")).logits[0].argmax(-1).cpu() for p in prompts]
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return top1


def test_bf16_top1_agrees_with_fp32_transformers(llama3_dir):
    """bf16 engine vs transformers fp32, 4 x 1024 teacher-forced positions; transformers' own
    bf16 run is measured beside it as the floor bf16 rounding allows on random weights."""
    prompts = _prompts(4, 1024)
    with LLM(llama3_dir, dtype="bfloat16", max_model_len=2048, enforce_eager=True) as llm:
        ours = [llm.model_runner.forward_logits(p).argmax(-1).cpu() for p in prompts]
    gc.collect()
    ref = _hf_top1(llama3_dir, prompts, torch.float32)
    hf_bf16 = _hf_top1(llama3_dir, prompts, torch.bfloat16)
    agree = torch.cat([a == b for a, b in zip(ours, ref)]).float().mean().item()
    hf_agree = torch.cat([a == b for a, b in zip(hf_bf16, ref)]).float().mean().item()
    report = {"positions": 4096, "nanovllm_bf16_vs_fp32": agree, "transformers_bf16_vs_fp32": hf_agree}
    print(json.dumps(report))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "top1.json"), "w") as f:
            json.dump(report, f)
    assert agree >= hf_agree - 0.005, report


@pytest.mark.parametrize("case", ["identical5", "batch10"])
def test_cuda_graphs_match_eager(llama3_dir, case):
    prompts = _prompts(1, 300) * 5 if case == "identical5" else _prompts(10, 257, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        with LLM(llama3_dir, dtype="bfloat16", max_model_len=2048, max_num_seqs=12,
                 enforce_eager=eager, gpu_memory_utilization=0.5) as llm:
            outs[eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        gc.collect()
    assert outs[True] == outs[False]
    if case == "identical5":
        assert all(o == outs[False][0] for o in outs[False])

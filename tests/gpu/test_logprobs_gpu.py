"""logprobs and prompt_logprobs on a CUDA GPU (run on the H200: ``python -m pytest
tests/gpu/test_logprobs_gpu.py -m gpu``): float32 against transformers' float32 (decode under
CUDA graphs included), and bf16 within bf16 noise, measured as transformers' own bf16 error."""
import gc

import pytest
import torch

from nanovllm import LLM, SamplingParams

from _util import random_prompt

pytestmark = pytest.mark.gpu

FLOAT32_TOL = 1e-3  # GPU float32 (other reduction orders than the CPU's) against transformers'


def _hf_logprobs(model_dir, ids: list[int], dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    with torch.inference_mode():
        logprobs = model(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1).cpu()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return logprobs


def _generate(model_dir, prompt, dtype):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    with LLM(model_dir, dtype=dtype, device="cuda", max_model_len=1024, gpu_memory_utilization=0.3) as llm:
        return llm.generate([prompt], sp, use_tqdm=False)[0]


def _prompt_values(out) -> torch.Tensor:
    ids = out.prompt_token_ids
    return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


def _sampled_values(out) -> torch.Tensor:
    c = out.outputs[0]
    return torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_float32_logprobs_match_transformers_with_cuda_graphs(arch, request):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompt = random_prompt(300, seed=1700)
    out = _generate(model_dir, prompt, "float32")
    tokens = out.outputs[0].token_ids
    ref = _hf_logprobs(model_dir, prompt + tokens, torch.float32)
    want_prompt = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(_prompt_values(out), want_prompt, rtol=0, atol=FLOAT32_TOL)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    torch.testing.assert_close(_sampled_values(out), ref[rows, torch.tensor(tokens)], rtol=0, atol=FLOAT32_TOL)
    for d, row in zip(out.outputs[0].logprobs, rows):  # every top-5 entry, by token id
        for t, lp in d.items():
            assert abs(lp.logprob - float(ref[row, t])) <= FLOAT32_TOL


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_bf16_logprobs_within_bf16_noise(arch, request):
    """Teacher-forced prompt logprobs: our bf16 engine's error against transformers' float32 is
    no larger than transformers' own bf16 error (ours keeps the logits in float32)."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    prompt = random_prompt(600, seed=1710)
    ours = _prompt_values(_generate(model_dir, prompt, "bfloat16"))
    positions, targets = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    ref = _hf_logprobs(model_dir, prompt, torch.float32)[positions, targets]
    hf_bf16 = _hf_logprobs(model_dir, prompt, torch.bfloat16)[positions, targets]
    ours_err, hf_err = (ours - ref).abs(), (hf_bf16 - ref).abs()
    assert not torch.isnan(ours).any()
    assert ours_err.mean() <= 1.5 * hf_err.mean() + 1e-3, (ours_err.mean(), hf_err.mean())
    assert ours_err.max() <= 2 * hf_err.max() + 1e-3, (ours_err.max(), hf_err.max())
    assert ours_err.max() < 0.25

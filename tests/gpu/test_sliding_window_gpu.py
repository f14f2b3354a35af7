"""The sliding-window checkpoint of tests/conftest.py on a CUDA GPU: transformers' greedy tokens in
float32 through CUDA graphs (window buffers), eagerly, with the host tier and with chunked prefill;
bf16 graphs equal bf16 eager."""
import pytest
import torch

from _util import build_llm, greedy, random_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = dict(device="cuda", enforce_eager=False, max_model_len=2048, num_kvcache_blocks=32)


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, seed=500 + n) for n in (700, 900, 90, 1500)]


@pytest.fixture(scope="module")
def reference(mistral_dir, prompts):
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=None, pad_token_id=3)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("opts", [dict(), dict(enforce_eager=True), dict(max_num_batched_tokens=256),
                                  dict(enable_cpu_offload=True, num_kvcache_blocks=3, num_cpu_kvcache_blocks=32)],
                         ids=["graphs", "eager", "chunked", "host-tier"])
def test_float32_matches_transformers(mistral_dir, prompts, reference, opts):
    with build_llm(mistral_dir, **{**GPU, **opts}) as llm:
        tokens = [o["token_ids"] for o in llm.generate(prompts, greedy(64), use_tqdm=False)]
        assert llm.get_kv_cache_stats()["released_blocks"] > 0
    assert tokens == reference


def test_bf16_graphs_equal_eager(mistral_dir, prompts):
    runs = []
    for eager in (False, True):
        with build_llm(mistral_dir, **{**GPU, "dtype": "bfloat16", "enforce_eager": eager}) as llm:
            runs.append([o["token_ids"] for o in llm.generate(prompts, greedy(64), use_tqdm=False)])
    assert runs[0] == runs[1]

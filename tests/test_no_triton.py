"""Without Triton installed (macOS, Windows, minimal Linux) nanovllm imports and generates on CPU
through the torch references (issue 15).

A child interpreter hides Triton the way an uninstalled package looks: ``sys.modules["triton"] =
None`` before anything is imported, so ``import triton`` raises ModuleNotFoundError and
``importlib.util.find_spec("triton")`` returns None (what torch checks). The child's greedy tokens
must equal this process's, which has Triton installed (on CPU both run the references).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from _util import ENGINE_DEFAULTS, build_llm, greedy, random_prompt

PROMPTS = [random_prompt(40, seed=1), random_prompt(700, seed=2)]
MAX_TOKENS = 8
CONFIGS = {
    "full": {},
    "xattn_bsa": dict(sparse_policy="XATTN_BSA", sparse_threshold=0.5, sparse_block_size=64, sparse_stride=8),
    "tiered_quest": dict(enable_cpu_offload=True, num_kvcache_blocks=2, num_cpu_kvcache_blocks=8, sparse_policy="QUEST",
                          sparse_token_budget=32),
}

CHILD = """
import importlib.util, json, sys
sys.modules["triton"] = None  # an uninstalled package, as import and find_spec see it
from nanovllm import LLM, SamplingParams
from nanovllm.ops import backend
model_dir, defaults, configs, prompts, max_tokens = json.loads(sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
tokens = {}
for name, config in configs.items():
    with LLM(model_dir, **{**defaults, **config}) as llm:
        tokens[name] = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
print(json.dumps({"has_triton": backend.HAS_TRITON, "find_spec": importlib.util.find_spec("triton") is None,
                  "triton_modules": loaded, "tokens": tokens}))
"""


def _run_child(model_dir) -> dict:
    root = Path(__file__).resolve().parents[1]
    payload = json.dumps([str(model_dir), ENGINE_DEFAULTS, CONFIGS, PROMPTS, MAX_TOKENS])
    result = subprocess.run([sys.executable, "-c", CHILD, payload], cwd=root, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_and_generate_without_triton(qwen3_dir):
    child = _run_child(qwen3_dir)
    assert child["has_triton"] is False
    assert child["find_spec"] is True
    assert child["triton_modules"] == ["triton"]  # only the hiding entry itself
    for name, config in CONFIGS.items():
        with build_llm(qwen3_dir, **config) as llm:
            expected = [out["token_ids"] for out in llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)]
        assert child["tokens"][name] == expected, name
        assert all(len(t) == MAX_TOKENS for t in expected)

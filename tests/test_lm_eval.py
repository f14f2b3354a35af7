"""The lm-eval backend (``nanovllm.integrations.lm_eval``) against lm-eval's own ``hf`` backend, with
SmolLM2-135M-Instruct in float32 on the CPU, on two local tasks written here (no download): a
multiple-choice log-likelihood task and a ``generate_until`` task, 24 documents each. Per
document: log-likelihoods within 1e-4, the same choices, the same greedy generations; the same
with the host tier on and a GPU tier of 2 blocks (so long documents spill)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import lm_eval  # the test extra installs it
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
COUNTRIES = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
             ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Russia", "Moscow"), ("Greece", "Athens"),
             ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Ireland", "Dublin"),
             ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
             ("Hungary", "Budapest"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"),
             ("China", "Beijing"), ("India", "New Delhi"), ("Cuba", "Havana"), ("Chile", "Santiago")]
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _write_tasks(root: Path) -> Path:
    """Two lm-eval tasks as JSONL + YAML under ``root``: ``nano_mc`` (4 choices, the answer's
    index) and ``nano_gen`` (greedy, until a newline or a period; every fourth context carries
    ~700 tokens of filler, more than two 256-token KV blocks)."""
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    with mc.open("w") as f:
        for i, (country, capital) in enumerate(COUNTRIES):
            others = [c for _, c in COUNTRIES if c != capital]
            choices = [others[(i + k) % len(others)] for k in range(3)]
            choices.insert(i % 4, capital)
            f.write(json.dumps({"question": f"What is the capital of {country}?", "choices": choices,
                                "answer": i % 4}) + "\n")
    with gen.open("w") as f:
        for i, (country, capital) in enumerate(COUNTRIES):
            context = FILLER * 45 if i % 4 == 0 else ""
            f.write(json.dumps({"prompt": f"{context}Q: What is the capital of {country}?\nA: The capital of "
                                          f"{country} is", "target": f" {capital}"}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (root / "nano_mc.yaml").write_text(
        f"task: nano_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\noutput_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (root / "nano_gen.yaml").write_text(
        f"task: nano_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen}\noutput_type: generate_until\n"
        "doc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{target}}\"\ngeneration_kwargs:\n"
        "  until: [\"\\n\", \".\"]\n  max_gen_toks: 12\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return root


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from nanovllm.fetch import fetch_model

    return fetch_model()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return _write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


def _evaluate(model: str, model_args: str, tasks: Path, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    import nanovllm.integrations.lm_eval  # noqa: F401  (registers "nanovllm")

    result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["nano_mc", "nano_gen"],
                                     task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                     **kwargs)
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in result["samples"].items()}


@pytest.fixture(scope="module")
def hf_samples(smollm2_dir, tasks):
    return _evaluate("hf", f"pretrained={smollm2_dir},dtype=float32", tasks, device="cpu", batch_size=1)


def _assert_same(got: dict, want: dict):
    assert [s["doc_id"] for s in got["nano_mc"]] == list(range(len(COUNTRIES)))
    for g, w in zip(got["nano_mc"], want["nano_mc"]):
        (g_ll, g_greedy), (w_ll, w_greedy) = zip(*g["filtered_resps"]), zip(*w["filtered_resps"])
        assert max(abs(a - b) for a, b in zip(g_ll, w_ll)) < TOL, (g["doc_id"], g_ll, w_ll)
        assert g_greedy == w_greedy and g["acc"] == w["acc"], g["doc_id"]
        assert max(range(4), key=lambda k: g_ll[k]) == max(range(4), key=lambda k: w_ll[k])
    assert [s["filtered_resps"] for s in got["nano_gen"]] == [s["filtered_resps"] for s in want["nano_gen"]]
    assert [s["exact_match"] for s in got["nano_gen"]] == [s["exact_match"] for s in want["nano_gen"]]


@pytest.mark.slow
def test_nanovllm_backend_equals_hf(smollm2_dir, tasks, hf_samples):
    got = _evaluate("nanovllm", f"pretrained={smollm2_dir},dtype=float32,device=cpu,enforce_eager=True,"
                                "max_model_len=2048,num_kvcache_blocks=16", tasks)
    _assert_same(got, hf_samples)
    assert any(s["exact_match"] for s in got["nano_gen"])  # the model knows some capitals


@pytest.mark.slow
def test_nanovllm_backend_with_host_tier_equals_hf(smollm2_dir, tasks, hf_samples, monkeypatch):
    """The host tier on, the GPU tier capped at 2 blocks: the long contexts spill to the host tier
    and are read back through the ring; every option passes through model_args as a string."""
    import nanovllm.integrations.lm_eval as backend

    engines = []
    init = backend.NanoVLLM.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self.llm)

    monkeypatch.setattr(backend.NanoVLLM, "__init__", recording_init)
    got = _evaluate("nanovllm", f"pretrained={smollm2_dir},dtype=float32,device=cpu,enforce_eager=True,"
                                "max_model_len=2048,enable_cpu_offload=True,num_kvcache_blocks=2,"
                                "num_cpu_kvcache_blocks=16,num_ring_slots=2,sparse_policy=FULL,batch_size=8", tasks)
    _assert_same(got, hf_samples)
    stats = engines[0].get_kv_cache_stats()
    assert stats["gpu_blocks"] == 2 and stats["host_blocks"] == 16 and stats["spilled_blocks"] > 0


def test_model_args_are_parsed_as_the_options_types():
    from nanovllm.integrations.lm_eval import engine_arguments

    parsed = engine_arguments({"enable_cpu_offload": "true", "num_kvcache_blocks": "8", "sparse_threshold": "0.5",
                               "max_model_len": "None", "sparse_policy": "quest", "tokenizer": "123",
                               "sparse_layer_budget_weights": " 2 1 0.5 "})
    assert parsed == {"enable_cpu_offload": True, "num_kvcache_blocks": 8, "sparse_threshold": 0.5,
                      "max_model_len": None, "sparse_policy": "quest", "tokenizer": "123",
                      "sparse_layer_budget_weights": (2.0, 1.0, 0.5)}
    assert engine_arguments({"sparse_layer_budget_weights": "1 x"}) == {"sparse_layer_budget_weights": "1 x"}, \
        "not numbers: left to the engine, which refuses it by name"


def test_generate_until_is_greedy_unless_the_task_samples():
    """lm-eval's hf backend decodes greedily unless do_sample is true; normalize_gen_kwargs sets no
    temperature when a task gives neither, so the backend must (SamplingParams' default is 1.0)."""
    from nanovllm.integrations.lm_eval import generation_params

    for kwargs, temperature in (({"until": ["\n"]}, 0.0), ({"until": ["\n"], "do_sample": False}, 0.0),
                                ({"until": ["\n"], "do_sample": False, "temperature": 0.7}, 0.0),
                                ({"until": ["\n"], "temperature": 0.7}, 0.7),
                                ({"until": ["\n"], "do_sample": True, "temperature": 0.5}, 0.5)):
        params, until, max_gen_toks = generation_params(kwargs, "<eos>", 32)
        assert params.temperature == temperature, kwargs
        assert until == ["\n", "<eos>"] and params.stop == until and params.max_tokens == max_gen_toks == 32
    params, until, _ = generation_params({"until": ["\n"], "max_gen_toks": 5}, "<eos>", 32, stop_at_eos_only=True)
    assert params.stop == ["<eos>"] and until == ["\n", "<eos>"] and params.max_tokens == 5


def test_backend_is_registered_on_import_only():
    code = ("import sys, nanovllm, nanovllm.integrations; assert 'lm_eval' not in sys.modules; "
            "import nanovllm.integrations.lm_eval; from lm_eval.api.registry import get_model; "
            "print(get_model('nanovllm').__name__, get_model('hf').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert out.stdout.split() == ["NanoVLLM", "HFLM"]


def test_lm_evals_default_device_runs_where_cuda_is_absent(monkeypatch):
    """lm-eval passes device="cuda:0" on every run; without CUDA the engine picks the CPU, and a
    device the backend cannot serve is refused by name."""
    from nanovllm.integrations.lm_eval import _device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _device("cuda:0") == "auto" and _device("cuda") == "auto" and _device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _device("cuda:0") == "cuda" and _device(None) == "auto"
    with pytest.raises(ValueError, match="'cuda:1'.*'cuda', 'cuda:0' or 'cpu'"):
        _device("cuda:1")


@pytest.mark.slow
def test_command_line_runs_lm_eval_with_the_backend(smollm2_dir, tasks, tmp_path):
    """``python -m nanovllm.integrations.lm_eval`` takes lm-eval's own arguments (its default
    ``--device`` included, on this CUDA-less machine), ``--batch_size auto`` as the README gives it."""
    out = subprocess.run(
        [sys.executable, "-m", "nanovllm.integrations.lm_eval", "--model", "nanovllm", "--batch_size", "auto",
         "--model_args",
         f"pretrained={smollm2_dir},dtype=float32,enforce_eager=True,max_model_len=1024,num_kvcache_blocks=8",
         "--tasks", "nano_mc", "--include_path", str(tasks), "--limit", "4",
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "HF_DATASETS_OFFLINE": "1"}, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "nano_mc" in out.stdout and "acc" in out.stdout and "batch_size: auto" in out.stdout

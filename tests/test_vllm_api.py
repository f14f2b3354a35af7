"""vLLM's offline API on the tiny random checkpoints (CPU, float32): RequestOutput and dict-style
access, logprobs and prompt_logprobs against transformers, every SamplingParams field against a
reference written here, n completions, stop strings, chat, prompt forms, Hub ids, and the bugs a
new user found (each test here failed before its fix)."""
import json
import math
from fnmatch import fnmatch
import os
import shutil
import types

import numpy as np
import pytest
import torch

from nanovllm import CompletionOutput, LLM, RequestOutput, SamplingParams
from nanovllm.layers.sampler import apply_min_p, apply_penalties, Penalties

from _util import (ARCHS, ENGINE_DEFAULTS, LOGPROB_TOL as TOL, VOCAB_SIZE, build_llm, check_logprobs, greedy,
                   hf_logprobs, random_prompt, token_ids)

@pytest.fixture(scope="module")
def llm(qwen3_dir):
    # max_logprobs=-1: requests may ask for the whole vocabulary (logprobs=-1), as in vLLM
    engine = build_llm(qwen3_dir, num_kvcache_blocks=16, max_num_batched_tokens=512, max_logprobs=-1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], steps: int, adjust=None, stop=None) -> list[int]:
    """Greedy decoding with transformers, one full forward per token; ``adjust(logits, out,
    step)`` edits the last logits in place; ``stop(token, step)`` ends the loop."""
    out = []
    for step in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        logits = logits.clone()  # a normal tensor, editable outside inference mode
        if adjust:
            adjust(logits, out, step)
        out.append(int(logits.argmax()))
        if stop and stop(out[-1], step):
            break
    return out


# ---- outputs -------------------------------------------------------------------------------

def test_request_output_fields_and_dict_access(llm):
    prompt = random_prompt(20, seed=1500)
    outs = llm.generate([prompt, "abc def"], greedy(5), use_tqdm=False)
    assert all(isinstance(o, RequestOutput) for o in outs)
    first = outs[0]
    assert first.prompt is None and first.prompt_token_ids == prompt and first.finished
    assert first.prompt_logprobs is None and first.num_cached_tokens == 0
    assert outs[1].prompt == "abc def"
    assert outs[1].prompt_token_ids == llm.get_tokenizer().encode("abc def")
    assert first.request_id != outs[1].request_id and isinstance(first.request_id, str)
    (c,) = first.outputs
    assert isinstance(c, CompletionOutput) and c.index == 0 and c.finished()
    assert len(c.token_ids) == 5 and c.finish_reason == "length" and c.stop_reason is None
    assert c.cumulative_logprob is None and c.logprobs is None
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
    # nano-vLLM's dict style reads the first completion.
    assert first["text"] == c.text and first["token_ids"] == c.token_ids
    assert first["finish_reason"] == "length" and first["num_cached_tokens"] == 0
    assert "text" in first and set(first.keys()) >= {"text", "token_ids", "finish_reason"}
    with pytest.raises(KeyError, match="outputs"):
        first["outputs"]


def test_request_ids_count_prompts_not_completions(llm):
    """As vLLM's request counter: one id per prompt, consecutive across calls, whatever ``n``."""
    prompts = [random_prompt(8, seed=1510), random_prompt(8, seed=1511)]
    first = [int(o.request_id) for o in llm.generate(prompts, SamplingParams(n=3, max_tokens=2), use_tqdm=False)]
    again = [int(o.request_id) for o in llm.generate(prompts, greedy(2), use_tqdm=False)]
    assert first == [first[0], first[0] + 1] and again == [first[0] + 2, first[0] + 3]


def test_get_tokenizer(llm):
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("hello")) == "hello"


def test_prompt_forms_give_the_same_tokens(llm):
    tokenizer = llm.get_tokenizer()
    text = "qudfpgs yvgdpmigu akpy"
    ids = tokenizer.encode(text)
    forms = [text, {"prompt": text}, ids, {"prompt_token_ids": ids}, np.array(ids), torch.tensor(ids),
             {"prompt_token_ids": np.array(ids)}, {"prompt": "shown, not tokenized", "prompt_token_ids": ids}]
    outs = llm.generate(forms, greedy(6), use_tqdm=False)
    assert len({tuple(o["token_ids"]) for o in outs}) == 1
    assert [o.prompt for o in outs] == [text, text] + [None] * 5 + ["shown, not tokenized"]
    assert all(o.prompt_token_ids == ids for o in outs)
    single = llm.generate({"prompt_token_ids": ids}, greedy(6), use_tqdm=False)
    assert len(single) == 1 and single[0]["token_ids"] == outs[0]["token_ids"]


def test_vllm_prompt_types(llm):
    """``from vllm.inputs import TokensPrompt, TextPrompt`` ports as ``nanovllm.inputs``, and
    ``from vllm import TokensPrompt`` as ``from nanovllm import TokensPrompt``."""
    import nanovllm
    from nanovllm.inputs import TextPrompt, TokensPrompt

    assert (nanovllm.TextPrompt, nanovllm.TokensPrompt) == (TextPrompt, TokensPrompt)

    text = "qudfpgs yvgdpmigu akpy"
    ids = llm.get_tokenizer().encode(text)
    outs = llm.generate([TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids),
                         TokensPrompt(prompt_token_ids=ids, prompt="shown")], greedy(6), use_tqdm=False)
    assert len({tuple(o["token_ids"]) for o in outs}) == 1
    assert [o.prompt for o in outs] == [text, None, "shown"]


@pytest.mark.parametrize("bad,shown", [
    ({"prompt": 5}, r"a dict prompt's 'prompt' must be a string, got int"),
    ({"prompt": "a", "prompt_token_ids": 7}, r"'prompt_token_ids' must be a list of token ids, got int"),
    ({"prompt_token_ids": "abc"}, r"'prompt_token_ids' must be a list of token ids, got str"),
    ({"multi_modal_data": {}}, r"a prompt must be a string or a list of token ids, got a dict with keys"),
    ({}, r"a prompt must be a string or a list of token ids, got a dict with keys \[\]")])
def test_malformed_prompt_dict(llm, bad, shown):
    with pytest.raises(ValueError, match=shown):
        llm.generate([bad], greedy(1), use_tqdm=False)
    assert llm.is_finished()


@pytest.mark.parametrize("prompts", [None, 5, 2.5, object()], ids=["None", "int", "float", "object"])
def test_generate_prompts_of_the_wrong_type_name_the_argument(llm, prompts):
    """generate(None) and generate(5) raised a bare TypeError from deep inside (len(None))."""
    with pytest.raises(ValueError, match=r"^prompts must be a prompt .* or a list of prompts, got"):
        llm.generate(prompts, greedy(1), use_tqdm=False)
    assert llm.is_finished()


def test_generate_of_no_prompts(llm):
    assert llm.generate([], greedy(1), use_tqdm=False) == []


# ---- logprobs and prompt_logprobs against transformers ----------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_and_prompt_logprobs_match_transformers(arch, request):
    """Greedy and sampled rows (temperature, top-k: logprobs are raw, before them), chunked
    prefill (64-token budget) and a batch mixing requests with and without logprobs."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"{arch}_dir")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [random_prompt(n, seed=1510 + n) for n in (100, 30, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=4, prompt_logprobs=3),
              SamplingParams(temperature=0.7, top_k=50, seed=3, max_tokens=4, ignore_eos=True, logprobs=0,
                             prompt_logprobs=0),
              greedy(4)]
    with build_llm(model_dir, max_num_batched_tokens=64) as engine:
        tokenizer = engine.get_tokenizer()
        outs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs):
        (c,) = out.outputs
        if sp.logprobs is None:
            assert c.logprobs is None and out.prompt_logprobs is None and c.cumulative_logprob is None
            continue
        ref = hf_logprobs(model, prompt + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_logprobs(entry, token, ref[len(prompt) - 1 + i], sp.logprobs, tokenizer)
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            check_logprobs(out.prompt_logprobs[j], prompt[j], ref[j - 1], sp.prompt_logprobs, tokenizer)


def test_prompt_logprobs_take_no_prefix_cache_hits(llm, hf):
    """Cached positions have no logits: a request with prompt_logprobs computes its whole prompt
    (num_cached_tokens 0) although its first block is cached; the next request hits it again."""
    prompt = random_prompt(300, seed=1520)
    before = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    with_logprobs = llm.generate([prompt], greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    after = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    assert before.num_cached_tokens == 0 and after.num_cached_tokens == 256
    assert with_logprobs.num_cached_tokens == 0
    assert with_logprobs["token_ids"] == before["token_ids"] == after["token_ids"]
    ref = hf_logprobs(hf, prompt)
    got = torch.tensor([d[t].logprob for d, t in zip(with_logprobs.prompt_logprobs[1:], prompt[1:])])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_logprobs_of_the_whole_vocabulary(llm, hf):
    prompt = random_prompt(12, seed=1525)
    out = llm.generate([prompt], greedy(2, logprobs=-1), use_tqdm=False)[0]
    entry = out.outputs[0].logprobs[0]
    assert len(entry) == VOCAB_SIZE
    ref = hf_logprobs(hf, prompt)[-1]
    got = torch.tensor([entry[t].logprob for t in range(VOCAB_SIZE)])
    torch.testing.assert_close(got, ref, rtol=0, atol=TOL)


def test_host_tier_gives_the_same_logprobs(qwen3_dir, llm):
    """With a 2-block GPU tier the 600-token prompt is prefilled in chunks whose prefixes are on
    the host tier: prompt logprobs gathered chunk by chunk equal the GPU-only engine's, and so do
    the sampled tokens' logprobs."""
    prompts = [random_prompt(600, seed=1527), random_prompt(20, seed=1528)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    want = llm.generate(prompts, sp, use_tqdm=False)
    with build_llm(qwen3_dir, enable_cpu_offload=True, num_kvcache_blocks=2, num_cpu_kvcache_blocks=8) as offload:
        got = offload.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(want, got):
        assert a["token_ids"] == b["token_ids"] and len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for da, db in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert next(iter(da)) == next(iter(db))  # the same token; its top-k may swap near-ties
            assert sorted(v.logprob for v in da.values()) == pytest.approx(sorted(v.logprob for v in db.values()),
                                                                           abs=TOL)


# ---- penalties, min_p, min_tokens ------------------------------------------------------------

@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_equals_transformers_generate(llm, hf, penalty):
    prompt = random_prompt(30, seed=1530, high=200)  # a small id range: tokens repeat
    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=penalty),
                        use_tqdm=False)[0]["token_ids"]
    with torch.inference_mode():
        x = torch.tensor([prompt])
        theirs = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
                             repetition_penalty=penalty)[0, len(prompt):].tolist()
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]["token_ids"]
    assert ours == theirs
    assert ours != plain  # the penalty changed the output


def test_presence_and_frequency_penalties_against_reference(llm, hf):
    """OpenAI's definition: logit - frequency * count - presence * (count > 0), over output
    tokens only (the prompt's tokens are not penalised)."""
    prompt = random_prompt(25, seed=1540)
    for presence, frequency in ((1.5, 0.0), (0.0, 0.4), (-0.5, 0.3)):
        def adjust(logits, out, step):
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence

        want = hf_greedy(hf, prompt, 20, adjust)
        got = llm.generate([prompt], greedy(20, presence_penalty=presence, frequency_penalty=frequency),
                           use_tqdm=False)[0]["token_ids"]
        assert got == want, (presence, frequency)
    assert want != hf_greedy(hf, prompt, 20)  # the penalties changed the output


def test_penalties_unit_against_reference():
    """apply_penalties on random logits against a per-row loop written here."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=gen) * 3
    prompts = [[1, 2, 2, 7], [], [4]]
    outputs = [[7, 7, 9], [3, 3, 3, 1], []]
    rep, pres, freq = [1.3, 1.0, 0.5], [0.5, -1.0, 2.0], [0.2, 0.7, -0.3]
    def pairs(lists):
        return (torch.tensor([i for i, tokens in enumerate(lists) for _ in tokens], dtype=torch.int64),
                torch.tensor([t for tokens in lists for t in tokens], dtype=torch.int64))

    got = apply_penalties(logits, Penalties(torch.tensor(rep), torch.tensor(pres), torch.tensor(freq),
                                            pairs(prompts), pairs(outputs)))
    want = logits.clone()
    for i in range(3):
        for t in set(prompts[i]) | set(outputs[i]):
            want[i, t] = want[i, t] * rep[i] if want[i, t] < 0 else want[i, t] / rep[i]
        for t in set(outputs[i]):
            want[i, t] -= freq[i] * outputs[i].count(t) + pres[i]
    torch.testing.assert_close(got, want)


def test_min_p_unit_against_reference():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 64, generator=gen) * 2
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    got = apply_min_p(logits, min_p)
    for row in range(4):
        probs = [math.exp(v) for v in logits[row].tolist()]
        top = max(probs)
        for t, p in enumerate(probs):
            kept = p >= float(min_p[row]) * top
            assert (got[row, t] == logits[row, t]) if kept else got[row, t] == -math.inf, (row, t)


def test_min_p_keeps_only_likely_tokens(llm, hf):
    """Every token sampled with min_p has a probability (at that temperature, by transformers)
    of at least min_p times the most likely token's; min_p=1 is greedy."""
    prompt = random_prompt(30, seed=1550)
    temperature, min_p = 0.05, 0.3
    out = llm.generate([prompt], SamplingParams(temperature=temperature, min_p=min_p, seed=9, max_tokens=16,
                                                ignore_eos=True), use_tqdm=False)[0]["token_ids"]
    probs = (hf_logprobs(hf, prompt + out)[len(prompt) - 1:-1] / temperature).softmax(-1)
    chosen = probs[torch.arange(len(out)), torch.tensor(out)]
    assert bool((chosen >= min_p * probs.amax(-1) * (1 - 1e-4)).all())
    unfiltered = llm.generate([prompt], SamplingParams(temperature=temperature, seed=9, max_tokens=16,
                                                       ignore_eos=True), use_tqdm=False)[0]["token_ids"]
    assert unfiltered != out  # min_p changed what was sampled
    plain = llm.generate([prompt], greedy(16), use_tqdm=False)[0]["token_ids"]
    one = llm.generate([prompt], SamplingParams(temperature=1.0, min_p=1.0, seed=9, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    assert one == plain


def test_min_tokens_masks_stop_ids_against_reference(llm, hf):
    prompt = random_prompt(40, seed=1560)
    plain = hf_greedy(hf, prompt, 12)
    stop = plain[1]
    early = llm.generate([prompt], greedy(12, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert early["token_ids"] == plain[:2] and early["finish_reason"] == "stop"
    assert early.outputs[0].stop_reason == stop

    def adjust(logits, out, step):
        if step < 5:
            logits[stop] = -math.inf

    want = hf_greedy(hf, prompt, 12, adjust, stop=lambda token, step: token == stop and step >= 5)
    got = llm.generate([prompt], greedy(12, stop_token_ids=[stop], min_tokens=5), use_tqdm=False)[0]
    assert got["token_ids"] == want and len(want) > 5
    assert stop not in want[:5]


def test_min_tokens_masks_eos(qwen3_dir, hf, tmp_path):
    """A copy of the checkpoint whose generation_config names an extra eos id."""
    prompt = random_prompt(40, seed=1565)
    plain = hf_greedy(hf, prompt, 10)
    for name in os.listdir(qwen3_dir):
        shutil.copy(os.path.join(qwen3_dir, name), tmp_path / name)
    gen_path = tmp_path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [2, plain[2]]
    gen_path.write_text(json.dumps(gen))
    with build_llm(str(tmp_path), num_kvcache_blocks=4) as engine:
        stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
        held = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=4),
                               use_tqdm=False)[0]
    assert stopped["token_ids"] == plain[:3] and stopped.outputs[0].stop_reason is None
    def adjust(logits, out, step):
        if step < 4:
            logits[plain[2]] = -math.inf

    want = hf_greedy(hf, prompt, 10, adjust, stop=lambda token, step: token in (2, plain[2]) and step >= 4)
    assert held["token_ids"] == want and len(want) > 4


# ---- stop strings and stop tokens ---------------------------------------------------------------

def expected_stop(tokenizer, ids: list[int], stop: str, include: bool):
    """The reference: the first prefix of ``ids`` whose text contains ``stop``; its text cut
    at the stop string's first occurrence (after it when ``include``)."""
    for t in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:t], skip_special_tokens=True)
        index = text.find(stop)
        if index != -1:
            return ids[:t], text[:index + len(stop) if include else index]
    return None


def test_stop_string_spanning_two_tokens(llm):
    tokenizer = llm.get_tokenizer()
    prompt = random_prompt(30, seed=1570)
    ids = llm.generate([prompt], greedy(24), use_tqdm=False)[0]["token_ids"]
    texts = [tokenizer.decode([t]) for t in ids]
    i = next(i for i in range(3, len(ids) - 1) if min(len(texts[i].strip()), len(texts[i + 1].strip())) >= 2
             and "\ufffd" not in texts[i] + texts[i + 1])
    stop = texts[i][-2:] + texts[i + 1][:2]
    assert not any(stop in t for t in texts)  # no single token holds it
    for include in (False, True):
        want_ids, want_text = expected_stop(tokenizer, ids, stop, include)
        out = llm.generate([prompt], greedy(24, stop=["never-generated", stop], include_stop_str_in_output=include),
                           use_tqdm=False)[0]
        c = out.outputs[0]
        assert c.token_ids == want_ids and c.text == want_text
        assert c.finish_reason == "stop" and c.stop_reason == stop
    single = llm.generate([prompt], greedy(24, stop=stop), use_tqdm=False)[0]  # a str is a list of one
    assert single["text"] == expected_stop(tokenizer, ids, stop, False)[1]
    missing = llm.generate([prompt], greedy(24, stop=["never-generated"]), use_tqdm=False)[0]
    assert missing["token_ids"] == ids and missing["finish_reason"] == "length"
    assert missing["text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_waits_for_min_tokens(llm):
    """vLLM: stop strings are looked for once more than min_tokens tokens are generated, in the
    text they added (and the len(stop) - 1 characters before it)."""
    tokenizer = llm.get_tokenizer()
    prompt = random_prompt(30, seed=1588)
    ids = llm.generate([prompt], greedy(16), use_tqdm=False)[0]["token_ids"]
    texts = [tokenizer.decode([t]) for t in ids]
    i = next(i for i, t in enumerate(texts) if len(t) >= 2 and "\ufffd" not in t and t in texts[i + 1:])
    stop = texts[i]  # a token's text that is generated again later
    first = llm.generate([prompt], greedy(16, stop=[stop]), use_tqdm=False)[0]
    want_ids, want_text = expected_stop(tokenizer, ids, stop, False)
    assert first["token_ids"] == want_ids and first["text"] == want_text and len(want_ids) <= i + 1
    text = tokenizer.decode(ids)
    later = text.find(stop, len(tokenizer.decode(ids[:i + 1])) + 1 - len(stop))
    assert later != -1
    held = llm.generate([prompt], greedy(16, stop=[stop], min_tokens=i + 1), use_tqdm=False)[0]
    assert len(held["token_ids"]) > i + 1 and held["text"] == text[:later]


def test_stop_token_is_kept_in_ids_and_left_out_of_text(llm):
    """vLLM (V1): the stop token id ends the request, stays in token_ids, and its text is left
    out unless include_stop_str_in_output."""
    tokenizer = llm.get_tokenizer()
    prompt = random_prompt(30, seed=1580)
    ids = llm.generate([prompt], greedy(16), use_tqdm=False)[0]["token_ids"]
    k = ids.index(ids[4])
    out = llm.generate([prompt], greedy(16, stop_token_ids=[ids[4]]), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:k + 1] and out.outputs[0].stop_reason == ids[4]
    assert out["text"] == tokenizer.decode(ids[:k])
    kept = llm.generate([prompt], greedy(16, stop_token_ids=[ids[4]], include_stop_str_in_output=True),
                        use_tqdm=False)[0]
    assert kept["text"] == tokenizer.decode(ids[:k + 1])


# ---- n, seeds, temperature ---------------------------------------------------------------------

def test_outputs_are_built_as_requests_finish(llm):
    """generate() detokenizes a request when its last sequence finishes, during the run: a short
    request's output exists steps before the long one ends; an n=2 request is built once, with
    both completions; outputs come back in input order."""
    built, steps, step = [], [0], llm._step

    def counting_step():
        steps[0] += 1
        return step()

    request = llm._outputs.request
    llm._step = counting_step
    llm._outputs.request = lambda request_id, prompt, seqs: built.append((steps[0], len(seqs))) or \
        request(request_id, prompt, seqs)
    try:
        prompts = [random_prompt(n, seed=1580 + n) for n in (10, 12, 14)]
        params = [greedy(2), greedy(12), SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=6, ignore_eos=True)]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm._step, llm._outputs.request
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 12, 6] and len(outs[2].outputs) == 2
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [n for _, n in built] == [1, 2, 1]  # short, the pair, long: in the order they finished
    assert built[0][0] < built[1][0] < built[2][0] == steps[0]


def test_n_completions_with_a_seed(llm):
    """n=4 with seed s: completion i equals a single request with seed s + i (vLLM's rule);
    reproducible; the four differ; grouped in one RequestOutput in index order."""
    prompts = [random_prompt(30, seed=1590)]
    sp = SamplingParams(temperature=1.0, n=4, seed=11, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    again = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out, out2 in zip(prompts, outs, again):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in out2.outputs]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 4
        singles = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8,
                                                             ignore_eos=True) for i in range(4)], use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == token_ids(singles)
        assert all(len(c.logprobs) == 8 for c in out.outputs)
        assert out["token_ids"] == out.outputs[0].token_ids


def test_n_completions_share_one_prompt_logprobs(llm):
    prompt = random_prompt(20, seed=1595)
    out = llm.generate([prompt], SamplingParams(temperature=1.0, n=3, max_tokens=4, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == 20
    unseeded = llm.generate([prompt], SamplingParams(temperature=1.0, n=3, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) == 3


@pytest.mark.parametrize("temperature", [1e-44, 1e-30, 1e-6, 5e-6])
def test_tiny_temperature_is_greedy(llm, temperature):
    """A positive temperature below vLLM's 1e-5 turned into inf logits, NaN probabilities and
    token 0; it is greedy now."""
    prompt = random_prompt(30, seed=1600)
    want = llm.generate([prompt], greedy(8), use_tqdm=False)[0]["token_ids"]
    got = llm.generate([prompt], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    assert got == want


def test_extreme_temperatures_give_no_nan(llm):
    """1e-5 (the smallest sampled temperature) scales logits by 1e5; 1e300 is inf in float32,
    and inf / -inf (a token masked by min_tokens) would be NaN: it samples uniformly instead."""
    prompt = random_prompt(30, seed=1605)
    want = llm.generate([prompt], greedy(8), use_tqdm=False)[0]["token_ids"]
    small = llm.generate([prompt], SamplingParams(temperature=1e-5, max_tokens=8, ignore_eos=True, seed=1),
                         use_tqdm=False)[0]["token_ids"]
    assert small == want
    huge = llm.generate([prompt], SamplingParams(temperature=1e300, min_tokens=8, max_tokens=8, seed=1,
                                                 stop_token_ids=[want[0]]), use_tqdm=False)[0]["token_ids"]
    assert len(set(huge)) == 8 and want[0] not in huge


# ---- mixing generate() with add_request() -------------------------------------------------------

def test_generate_refuses_to_run_requests_queued_with_add_request(llm):
    """generate() ran a request queued earlier with add_request to completion and dropped its
    output. It refuses now (nothing is queued or lost); step() still returns that request."""
    prompt = random_prompt(30, seed=1610)
    want = llm.generate([prompt], greedy(6), use_tqdm=False)[0]["token_ids"]
    seq_id = llm.add_request(prompt, greedy(6))
    with pytest.raises(RuntimeError, match=r"1 sequence\(s\) queued with add_request\(\) are unfinished"):
        llm.generate([random_prompt(10, seed=1611)], greedy(2), use_tqdm=False)
    with pytest.raises(RuntimeError, match=r"add_request"):
        llm.chat([{"role": "user", "content": "hi"}], greedy(2), chat_template="{{ messages[0]['content'] }}",
                 use_tqdm=False)
    done = {}
    while not llm.is_finished():
        done.update({s.seq_id: s.completion_token_ids for s in llm.step()[0]})
    assert done == {seq_id: want}
    assert llm.generate([prompt], greedy(6), use_tqdm=False)[0]["token_ids"] == want


def test_add_request_takes_prompt_forms_and_rejects_n(llm):
    with pytest.raises(ValueError, match=r"add_request queues one completion \(n=1\), got n=2"):
        llm.add_request([5, 6, 7], SamplingParams(n=2))
    seq_id = llm.add_request({"prompt": "abc"}, greedy(2))
    while not llm.is_finished():
        llm.step()
    assert isinstance(seq_id, int)


# ---- validation -------------------------------------------------------------------------------

BAD_FIELDS = [
    ("ignore_eos", "no"), ("ignore_eos", 1), ("n", 0), ("n", 2.0), ("stop", 5), ("stop", [""]),
    ("stop", ["a", 3]), ("stop_token_ids", [-1]), ("include_stop_str_in_output", "yes"), ("min_tokens", -1),
    ("min_tokens", 1.5), ("min_tokens", 65), ("presence_penalty", 2.5), ("presence_penalty", "1"),
    ("frequency_penalty", float("nan")), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", float("inf")), ("min_p", 1.5), ("min_p", -0.1), ("logprobs", -2), ("logprobs", 1.5),
    ("prompt_logprobs", "5"), ("skip_special_tokens", None), ("max_tokens", 0), ("temperature", "hot"),
    ("top_k", True), ("seed", "7"),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_bad_field_at_construction(field, value):
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_bad_field_edited_after_construction_is_caught_when_queued(llm, field, value):
    sp = SamplingParams(max_tokens=4)
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=rf"^sampling_params: {field}"):
        llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"^sampling_params\[1\]: {field}"):
        llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(), sp], use_tqdm=False)
    with pytest.raises(ValueError, match=rf"^sampling_params: {field}"):
        llm.add_request([5, 6, 7], sp)
    assert llm.is_finished()


def test_unsupported_sampling_field_is_refused():
    """vLLM's fields for what nanovllm lacks take their "off" value only (a ValueError naming the
    field otherwise); a name vLLM does not have is still a TypeError."""
    with pytest.raises(ValueError, match="best_of=2 is not supported"):
        SamplingParams(best_of=2)
    assert SamplingParams(best_of=None, n=2).n == 2
    with pytest.raises(TypeError, match="no_such_field"):
        SamplingParams(no_such_field=2)


def test_checks_against_the_vocabulary_at_queue_time(llm):
    with pytest.raises(ValueError, match=rf"stop_token_ids has token id {VOCAB_SIZE}, outside the vocabulary "
                                         rf"\[0, {VOCAB_SIZE}\)"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[7, VOCAB_SIZE]), use_tqdm=False)
    with pytest.raises(ValueError, match=rf"logprobs={VOCAB_SIZE + 1} is more than the vocabulary"):
        llm.generate([[5, 6]], SamplingParams(logprobs=VOCAB_SIZE + 1), use_tqdm=False)
    assert llm.is_finished()


def test_queued_params_are_a_copy(llm):
    """A SamplingParams edited while its request runs does not change the request."""
    sp = greedy(6)
    seq_id = llm.add_request([5, 6, 7], sp)
    sp.max_tokens, sp.stop_token_ids = 1, ["not checked again"]
    done = {}
    while not llm.is_finished():
        done.update({s.seq_id: s.completion_token_ids for s in llm.step()[0]})
    assert len(done[seq_id]) == 6


def test_max_tokens_none_and_default(llm):
    """max_tokens=None generates up to max_model_len (vLLM); the default stays nano-vLLM's 64."""
    prompt = random_prompt(1016, seed=1620)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None), use_tqdm=False)[0]
    assert len(out["token_ids"]) == ENGINE_DEFAULTS["max_model_len"] - 1016 and out["finish_reason"] == "length"
    assert SamplingParams().max_tokens == 64


# ---- chat ----------------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


def test_chat_equals_generate_on_the_templated_prompt(llm):
    tokenizer = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": "qudfpgs akpy"}],
                     [{"role": "system", "content": "yvgdpmigu"}, {"role": "user", "content": "akpy"}]]
    outs = llm.chat(conversations, greedy(6), chat_template=TEMPLATE, use_tqdm=False)
    for conversation, out in zip(conversations, outs):
        text = tokenizer.apply_chat_template(conversation, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
        assert out.prompt == text and text.endswith("<assistant>")
        ref = llm.generate([tokenizer.encode(text, add_special_tokens=False)], greedy(6), use_tqdm=False)[0]
        assert out["token_ids"] == ref["token_ids"]
    one = llm.chat(conversations[0], greedy(6), chat_template=TEMPLATE, add_generation_prompt=False,
                   use_tqdm=False)
    assert len(one) == 1 and not one[0].prompt.endswith("<assistant>")


@pytest.mark.parametrize("messages", [None, "hello", [], [[]], [{"role": "user", "content": "a"}, "b"]])
def test_chat_bad_messages(llm, messages):
    with pytest.raises(ValueError, match=r"^messages must be a conversation"):
        llm.chat(messages, greedy(2), chat_template=TEMPLATE, use_tqdm=False)


@pytest.mark.parametrize("messages,shown", [
    ([{"role": "user"}], r"conversation 0, message 0 needs a string 'content'"),   # jinja2 UndefinedError
    ([{"role": "user", "content": 5}], r"conversation 0, message 0 needs a string 'content'"),  # TypeError
    ([[{"role": "user", "content": "a"}], [{"content": "b"}]], r"conversation 1, message 0 needs a string 'role'"),
])
def test_chat_message_without_role_or_content(llm, messages, shown):
    with pytest.raises(ValueError, match=shown):
        llm.chat(messages, greedy(2), chat_template=TEMPLATE, use_tqdm=False)
    assert llm.chat([{"role": "user", "content": "a"}], greedy(2), chat_template=TEMPLATE, use_tqdm=False)[0].finished


def test_chat_template_kwargs_reach_the_template(llm):
    """vLLM's ``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``) are template variables."""
    template = TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    conversation = [{"role": "user", "content": "akpy"}]
    plain = llm.chat(conversation, greedy(2), chat_template=template, use_tqdm=False)[0]
    off = llm.chat(conversation, greedy(2), chat_template=template, use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert off.prompt == plain.prompt + "<no-think>"
    for bad, shown in (([("enable_thinking", False)], "must be a dict with string keys"),
                       ({1: True}, "must be a dict with string keys"),
                       ({"add_generation_prompt": False}, r"cannot set \['add_generation_prompt'\]")):
        with pytest.raises(ValueError, match=shown):
            llm.chat(conversation, greedy(2), chat_template=template, use_tqdm=False, chat_template_kwargs=bad)
    assert llm.is_finished()


@pytest.mark.parametrize("template,shown", [
    ("{{ bad syntax", r"chat_template failed: TemplateSyntaxError"),
    ("{{ raise_exception('no system role') }}", r"chat_template failed: TemplateError: no system role"),
])
def test_chat_broken_template_is_a_value_error(llm, template, shown):
    with pytest.raises(ValueError, match=shown):
        llm.chat([{"role": "user", "content": "a"}], greedy(2), chat_template=template, use_tqdm=False)
    assert llm.chat([{"role": "user", "content": "a"}], greedy(2), chat_template=TEMPLATE, use_tqdm=False)[0].finished


def test_chat_too_long_conversation_is_named(llm):
    long = [{"role": "user", "content": "akpy " * llm.llm_engine.config.max_model_len}]
    with pytest.raises(ValueError, match=r"^messages\[1\] has \d+ tokens, more than max_model_len="):
        llm.chat([[{"role": "user", "content": "a"}], long], greedy(2), chat_template=TEMPLATE, use_tqdm=False)
    assert llm.is_finished()
    with pytest.raises(ValueError, match=r"^sampling_params has 2 entries but messages has 1: "):
        llm.chat([{"role": "user", "content": "a"}], [greedy(2)] * 2, chat_template=TEMPLATE, use_tqdm=False)


def test_chat_without_a_template(llm):
    with pytest.raises(ValueError, match=r"chat_template"):
        llm.chat([{"role": "user", "content": "a"}], greedy(2), use_tqdm=False)
    assert llm.is_finished()


# ---- Hugging Face Hub ids -------------------------------------------------------------------------

def test_hub_id_is_downloaded_with_snapshot_download(qwen3_dir, tmp_path, monkeypatch):
    import nanovllm.hub as hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None):
        calls.append((repo_id, revision, cache_dir))
        target = tmp_path / "snapshot"
        target.mkdir(exist_ok=True)
        for name in os.listdir(qwen3_dir):
            if any(fnmatch(name, pattern) for pattern in allow_patterns):
                shutil.copy(os.path.join(qwen3_dir, name), target / name)
        return str(target)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    with LLM("tiny-org/tiny-qwen3", revision="v1", download_dir=str(tmp_path / "cache"),
             **{**ENGINE_DEFAULTS, "num_kvcache_blocks": 4}) as engine:
        out = engine.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0]
    with build_llm(qwen3_dir, num_kvcache_blocks=4) as local:
        assert out["token_ids"] == local.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0]["token_ids"]
    assert calls == [("tiny-org/tiny-qwen3", "v1", str(tmp_path / "cache"))]
    copied = sorted(os.listdir(tmp_path / "snapshot"))
    assert "config.json" in copied and "generation_config.json" in copied and "tokenizer.json" in copied
    assert any(name.endswith(".safetensors") for name in copied)


def test_hub_patterns_take_only_what_the_engine_reads():
    from nanovllm.hub import ALLOW_PATTERNS

    wanted = ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
              "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja"]
    unwanted = ["pytorch_model.bin", "model.gguf", "README.md", "onnx/model.onnx", "original/consolidated.00.pth",
                "flax_model.msgpack"]
    assert all(any(fnmatch(n, p) for p in ALLOW_PATTERNS) for n in wanted)
    assert not any(any(fnmatch(n, p) for p in ALLOW_PATTERNS) for n in unwanted)


@pytest.mark.parametrize("error,kind", [("RepositoryNotFoundError", ValueError),
                                        ("RevisionNotFoundError", ValueError),
                                        ("LocalEntryNotFoundError", RuntimeError)])
def test_unknown_or_offline_hub_id_names_it(monkeypatch, error, kind):
    import huggingface_hub.errors as errors

    import nanovllm.hub as hub

    def fake_snapshot_download(repo_id, **kwargs):
        cls = getattr(errors, error)
        if error == "LocalEntryNotFoundError":
            raise cls("cannot find the requested files in the disk cache and outgoing traffic is disabled")
        raise cls("404 Not Found", response=types.SimpleNamespace(headers={}, request=None))

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(kind, match=r"model 'no-org/no-such-model' is not a local directory"):
        LLM("no-org/no-such-model", device="cpu")


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    import nanovllm.hub as hub

    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: pytest.fail("a local path went to the Hub"))
    with pytest.raises(ValueError, match=r"does not exist"):
        LLM(str(tmp_path / "missing" / "model"), device="cpu")


# ---- tensor parallelism -------------------------------------------------------------------------

@pytest.mark.slow
def test_tensor_parallel_2_gives_tp1_logprobs_and_tokens(llama_tied_dir):
    """Spawned gloo TP=2: rank 0 samples with penalties, n and stop strings, and returns the same
    logprobs and prompt logprobs as TP=1 (prompt logprobs over a chunked prefill)."""
    prompts = [random_prompt(n, seed=1630 + n) for n in (90, 20)]
    params = [SamplingParams(temperature=0.9, n=2, seed=4, max_tokens=8, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2, presence_penalty=0.5, repetition_penalty=1.1, min_tokens=2),
              greedy(8, logprobs=1, frequency_penalty=0.3, stop=["zz"])]

    def run(**opts):
        with build_llm(llama_tied_dir, max_num_batched_tokens=64, **opts) as engine:
            return engine.generate(prompts, params, use_tqdm=False)

    ref, tp2 = run(), run(tensor_parallel_size=2)
    for a, b in zip(ref, tp2):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            for da, db in zip(ca.logprobs, cb.logprobs):
                assert list(da) == list(db)
                assert [v.logprob for v in da.values()] == pytest.approx([v.logprob for v in db.values()], abs=1e-4)
    want = [d[t].logprob for d, t in zip(ref[0].prompt_logprobs[1:], prompts[0][1:])]
    got = [d[t].logprob for d, t in zip(tp2[0].prompt_logprobs[1:], prompts[0][1:])]
    assert got == pytest.approx(want, abs=1e-4) and len(got) == 89

"""tools.divergence: where two greedy runs part and the logits there."""
import pytest

from _util import build_llm, greedy, random_prompt
from nanovllm import SamplingParams
from tools.divergence import decode_noise, first_difference, parting


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 2]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1


def test_parting_measures_the_tie_at_the_first_difference(llama_tied_dir):
    prompt = random_prompt(50, seed=900)
    with build_llm(llama_tied_dir) as llm:
        ours = llm.generate([prompt], greedy(6), use_tqdm=False)[0]["token_ids"]
        theirs = ours[:3] + [(ours[3] + 1) % 100 + 4] + ours[4:]
        assert parting(llm, prompt, ours, ours) is None
        p = parting(llm, prompt, ours, theirs)
    assert (p["step"], p["ours"], p["theirs"]) == (3, ours[3], theirs[3])
    assert p["logit_gap"] == pytest.approx(p["logit_ours"] - p["logit_theirs"], abs=1e-5)
    assert p["logit_gap"] > 0  # ours was the greedy argmax
    assert p["theirs_rank"] >= 1 and p["top2"][0] == p["logit_ours"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_noise_is_the_largest_change_of_a_candidate_gap(llama_tied_dir, dtype):
    """float32: decode and the teacher-forced forward agree to rounding; bfloat16: they disagree by
    bf16 rounding, more than float32's; a step whose logprobs are shifted by 0.5 for one candidate
    shows as 0.5."""
    prompt = random_prompt(50, seed=901)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4)
    with build_llm(llama_tied_dir, dtype=dtype) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        tokens, logprobs = list(out.token_ids), out.logprobs
        noise = decode_noise(llm, prompt, tokens, logprobs)
        step = dict(logprobs[2])
        moved = next(t for t in step if t != tokens[2])
        step[moved] = type(step[moved])(logprob=step[moved].logprob + 0.5)
        shifted = decode_noise(llm, prompt, tokens, logprobs[:2] + [step] + logprobs[3:])
        with pytest.raises(ValueError, match="one logprobs entry per token: 5 entries for 6 tokens"):
            decode_noise(llm, prompt, tokens, logprobs[:5])
    assert noise < (1e-4 if dtype == "float32" else 0.5)
    assert dtype == "float32" or noise > 1e-4
    assert shifted == pytest.approx(0.5, abs=noise + 1e-6) and shifted >= 0.5 - noise

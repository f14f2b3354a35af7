"""tools.divergence: where two greedy runs part and the logits there."""
import pytest

from _util import build_llm, greedy, random_prompt
from tools.divergence import first_difference, parting


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

"""The RULER generator (:mod:`tools.ruler`) with the SmolLM2 tokenizer: exact lengths
of every task at 500 and 2000 tokens, answers where each task puts them, the needle haystack of
the multi-key tasks, determinism by seed, aliases, errors and RULER's scoring. The evaluation
tool itself (CLI, end-to-end run) is tested in test_ruler.py."""

import re
from collections import Counter

import pytest

from tools import ruler

UNIT_LENGTHS = (500, 2000)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from nanovllm.fetch import fetch_model

    return AutoTokenizer.from_pretrained(fetch_model())


@pytest.fixture(scope="module")
def samples(tokenizer):
    """Two samples of every task at each unit-test length, built once."""
    return {(t, n): ruler.generate_samples(tokenizer, t, 2, n, seed=0)
            for t in ruler.TASKS for n in UNIT_LENGTHS}


@pytest.mark.parametrize("input_len", UNIT_LENGTHS)
@pytest.mark.parametrize("task", ruler.TASKS)
def test_exact_length_and_fields(samples, tokenizer, task, input_len):
    batch = samples[(task, input_len)]
    assert len(batch) == 2
    for s in batch:
        assert set(s) == {"task", "input_ids", "answers", "max_new_tokens"}
        assert s["task"] == task
        assert len(s["input_ids"]) == input_len
        assert all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in s["input_ids"])
        assert s["answers"] and all(isinstance(a, str) and a for a in s["answers"])
        assert s["max_new_tokens"] == ruler.MAX_NEW_TOKENS[task]
    assert batch[0]["input_ids"] != batch[1]["input_ids"]


EXPECTED_ANSWERS = {"niah_single_numbers": 1, "niah_single_essay_numbers": 1, "niah_single_words": 1,
                    "niah_single_uuids": 1, "niah_multikey": 1, "niah_multikey_needles": 1,
                    "niah_multikey_uuids": 1, "niah_multivalue": 4, "niah_multiquery": 4,
                    "vt": 5, "cwe": 10, "fwe": 3}
NEEDLE_KEY = r"([0-9a-z-]+)"  # "adjective-noun" words or UUIDs


@pytest.mark.parametrize("input_len", UNIT_LENGTHS)
@pytest.mark.parametrize("task", ruler.TASKS)
def test_answers_in_prompt(samples, tokenizer, task, input_len):
    """Each answer is where the task puts it: in a needle, a chain, or (most often) in a list."""
    for s in samples[(task, input_len)]:
        text = tokenizer.decode(s["input_ids"])
        answers = s["answers"]
        assert len(answers) == EXPECTED_ANSWERS[task]
        assert len(set(answers)) == len(answers)
        # The prompt ends with the chat template's assistant turn and the task's answer prefix.
        assert text.rstrip().endswith(("provided text are", "they are:", "in the list are:",
                                       "most frequently appeared words are:")), text[-200:]
        if task.startswith("niah"):
            type_v = {"words": "words", "uuids": "uuids"}.get(task.rsplit("_", 1)[-1], "numbers")
            for a in answers:
                assert re.search(rf"One of the special magic {type_v} for {NEEDLE_KEY} is: {re.escape(a)}\.", text), a
            question = text[text.index("What are all the special magic"):]
            needles = re.findall(rf"One of the special magic {type_v} for {NEEDLE_KEY} is: (\S+)\.", text)
            asked = [k for k, v in needles if v in answers]
            assert all(k in question for k in asked)
            if task == "niah_multikey":  # three distractor keys that are not asked for
                assert len(needles) == 4 and sum(k in question for k, _ in needles) == 1
        elif task == "vt":
            main = text[text.rindex("Memorize and track"):]  # after vt's in-context example
            value = re.search(r"assigned the value (\d+) in the text above", main).group(1)
            assert f"VAR {answers[0]} = {value}." in main
            for prev, cur in zip(answers, answers[1:]):
                assert f"VAR {cur} = VAR {prev}." in main
        elif task == "cwe":
            main = text[text.rindex("Below is a numbered list of words."):]
            listed = re.findall(r"\d+\. ([a-z]+)", main.split("\nQuestion:")[0])
            counts = Counter(listed)
            least_common = min(counts[a] for a in answers)
            others = [c for w, c in counts.items() if w not in answers]
            assert least_common > max(others, default=0), (counts, answers)
            assert [int(n) for n in re.findall(r"(\d+)\. ", main.split("\nQuestion:")[0])] == \
                list(range(1, len(listed) + 1))
        else:  # fwe
            words = text.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
            counts = Counter(w for w in words if w != "...")
            ranked = [w for w, _ in counts.most_common(4)]
            assert ranked[:3] == answers, (counts.most_common(5), answers)
            assert counts[answers[2]] > counts[ranked[3]]


UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


@pytest.mark.parametrize("input_len", UNIT_LENGTHS)
@pytest.mark.parametrize("task", ["niah_multikey_needles", "niah_multikey_uuids"])
def test_needle_haystack(samples, task, tokenizer, input_len):
    """RULER's "needle" haystack: the context holds nothing but needles (the last one cut to make
    the length exact), their keys are all distinct, and exactly one has the queried key and the
    answer as its value."""
    type_v, key_re, value_re = ("uuids", UUID, UUID) if task.endswith("uuids") else ("numbers", r"[a-z]+-[a-z]+", r"\d{7}")
    needle = re.compile(rf"One of the special magic {type_v} for ({key_re}) is: ({value_re})\.")
    for s in samples[(task, input_len)]:
        text = tokenizer.decode(s["input_ids"])
        context = text.split("afterwards.\n", 1)[1].rsplit("\nWhat are all the special magic", 1)[0]
        (query,) = re.findall(rf"What are all the special magic {type_v} for ({key_re}) mentioned", text)
        *lines, last = context.split("\n")
        matches = [needle.fullmatch(line) for line in lines]
        assert all(matches), [line for line, m in zip(lines, matches) if not m]
        assert needle.fullmatch(last) or "One of the special magic "[:len(last)] == last[:25], last
        keys = [m.group(1) for m in matches]
        assert len(set(keys)) == len(keys) >= 2
        ctx_tokens = len(tokenizer.encode(context, add_special_tokens=False))
        longest = max(len(tokenizer.encode("\n" + line, add_special_tokens=False)) for line in lines)
        assert len(lines) + 1 >= ctx_tokens // longest  # whole needles up to the cut one
        assert [m.group(2) for m in matches if m.group(1) == query] == s["answers"]
        assert needle.fullmatch(last) is None or needle.fullmatch(last).group(1) not in keys + [query]


def test_deterministic_by_seed(tokenizer):
    for task in ruler.TASKS:
        a = ruler.generate_samples(tokenizer, task, 2, 700, seed=3)
        b = ruler.generate_samples(tokenizer, task, 2, 700, seed=3)
        c = ruler.generate_samples(tokenizer, task, 2, 700, seed=4)
        assert a == b, task
        assert [s["input_ids"] for s in a] != [s["input_ids"] for s in c], task
    # A sample depends on its index, not on how many are asked for.
    assert ruler.generate_samples(tokenizer, "vt", 1, 700)[0] == ruler.generate_samples(tokenizer, "vt", 3, 700)[0]


def test_aliases_and_errors(tokenizer):
    assert ruler.generate_samples(tokenizer, "niah_single", 1, 500)[0]["task"] == "niah_single_numbers"
    assert ruler.resolve_task("variable_tracking") == "vt"
    assert [ruler.resolve_task(f"niah_{t}") for t in ("single_2", "multikey_1", "multikey_2", "multikey_3")] == \
        ["niah_single_essay_numbers", "niah_multikey", "niah_multikey_needles", "niah_multikey_uuids"]
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*niah_single_numbers"):
        ruler.generate_samples(tokenizer, "nope", 1, 500)
    with pytest.raises(ValueError, match="unknown task"):
        ruler.score("nope", "x", ["x"])
    for task in ruler.TASKS:
        with pytest.raises(ValueError, match=rf"input_len=50 is too small for task '{task}'.*at least (\d+) tokens") as exc:
            ruler.generate_samples(tokenizer, task, 1, 50)
        need = int(re.search(r"at least (\d+)", str(exc.value)).group(1))
        assert len(ruler.generate_samples(tokenizer, task, 1, need)[0]["input_ids"]) == need
    with pytest.raises(ValueError, match="num_samples must be"):
        ruler.generate_samples(tokenizer, "vt", -1, 500)
    with pytest.raises(ValueError, match="input_len must be"):
        ruler.generate_samples(tokenizer, "vt", 1, 0)
    assert ruler.generate_samples(tokenizer, "cwe", 0, 500) == []


def test_score_examples():
    assert ruler.score("niah_single_numbers", ": 1234567.", ["1234567"]) == 1.0
    assert ruler.score("niah_single_numbers", "I do not know", ["1234567"]) == 0.0
    assert ruler.score("niah_multivalue", "1, 2 and 4", ["1", "2", "3", "5"]) == 0.5
    assert ruler.score("niah_single_uuids", "ABCDEF12-0000", ["abcdef12-0000"]) == 1.0  # case-insensitive
    assert ruler.score("vt", " QWERT, ASDFG\x00zxcvb", ["QWERT", "ASDFG", "ZXCVB", "POIUY"]) == 0.75
    assert ruler.score("cwe", "1. cat 2. dog", ["cat", "dog", "owl", "fox"]) == 0.5
    assert ruler.score("fwe", "abcdef, ghijkl, mnopqr", ["abcdef", "ghijkl", "mnopqr"]) == 1.0

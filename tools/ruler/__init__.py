"""RULER-style synthetic long-context tasks, each prompt built to an exact token length.

After Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?" (2024), following RULER's task definitions (NVIDIA/RULER, scripts/synthetic.yaml and
scripts/data/synthetic/). Nothing is downloaded: word lists are in :mod:`.words`, and the
essay-like filler, pseudo-words, keys and values are generated from a seeded ``random.Random``.

Tasks (:data:`TASKS`; RULER's own names are accepted as aliases, see :data:`TASK_ALIASES`):

=============================  ===========================================================
``niah_single_numbers``        one needle in the repeated "The grass is green..." noise; value a
                               7-digit number (RULER ``niah_single_1``)
``niah_single_essay_numbers``  one needle in essay filler; value a 7-digit number (RULER
                               ``niah_single_2``)
``niah_single_uuids``          one needle in essay filler; value a UUID (RULER ``niah_single_3``)
``niah_single_words``          one needle in essay filler; value a word ("adjective-noun")
``niah_multikey``              4 needles with different keys in essay filler, one queried (3
                               distractors; RULER ``niah_multikey_1``)
``niah_multikey_needles``      the whole context is distractor needles, each with its own word
                               key and a number; one needle has the queried key (RULER
                               ``niah_multikey_2``)
``niah_multikey_uuids``        as ``niah_multikey_needles`` with UUID keys and UUID values (RULER
                               ``niah_multikey_3``)
``niah_multivalue``            4 needles with the same key; all 4 values are asked for
``niah_multiquery``            4 needles with different keys; all 4 keys are queried
``vt``                         variable tracking: a 4-hop chain ``VAR A = 12345``, ``VAR B = VAR
                               A``, ... hidden in noise; name every variable holding the value
``cwe``                        common-words extraction: a numbered word list, name the 10 most
                               frequent words
``fwe``                        frequent-words extraction: coded words drawn from a Zipf (alpha 2)
                               law, name the 3 most frequent ones
=============================  ===========================================================

Prompts use RULER's task templates and answer prefixes: the task text is one user message,
chat-templated with the model's tokenizer and a generation prompt, and the assistant turn
already starts with the task's answer prefix (e.g. "The special magic numbers for X mentioned
in the provided text are"), as RULER appends it after the model template. ``vt`` and ``cwe``
carry RULER's one in-context example when ``input_len >= ICL_MIN_INPUT_LEN``.

Exact lengths: the prompt is assembled from separately tokenized pieces (chat-template prefix,
task text, context, question, template suffix, answer prefix). The needle/vt haystacks are
cut at the token level right before the question (needles and chain statements always sit in
whole filler units; in the needle haystacks the cut piece is a distractor); ``cwe`` adds
single-occurrence words whose token counts make up the remainder; ``fwe`` pads with the noise
word ``...`` that the prompt tells the model to ignore.

Scoring (:func:`score`) is RULER's ``string_match_all``: the fraction of reference strings
contained in the output, case-insensitive, after control characters become newlines.

Modules: :mod:`.words` (vocabulary, filler, keys and values), :mod:`.haystack` (tokenizer cache,
exact-length haystack, chat-template frame), :mod:`.niah`, :mod:`.vt`, :mod:`.cwe`, :mod:`.fwe`.
"""

from __future__ import annotations

import functools
import random
import re

from . import cwe, fwe, niah, vt
from .haystack import ICL_MIN_INPUT_LEN, Tok, TooSmall

__all__ = [
    "TASKS",
    "TASK_ALIASES",
    "MAX_NEW_TOKENS",
    "ICL_MIN_INPUT_LEN",
    "resolve_task",
    "generate_samples",
    "score",
    "string_match_all",
]

# task -> build(tok, rng, input_len) -> (input_ids, answers)
_BUILDERS = {**{name: functools.partial(niah.build, spec=spec) for name, spec in niah.TASKS.items()},
             "vt": vt.build, "cwe": cwe.build, "fwe": fwe.build}
TASKS = tuple(_BUILDERS)
TASK_ALIASES = {
    "niah_single": "niah_single_numbers",
    "niah_single_1": "niah_single_numbers",
    "niah_single_2": "niah_single_essay_numbers",
    "niah_single_3": "niah_single_uuids",
    "niah_multikey_1": "niah_multikey",
    "niah_multikey_2": "niah_multikey_needles",
    "niah_multikey_3": "niah_multikey_uuids",
    "variable_tracking": "vt",
    "common_words_extraction": "cwe",
    "freq_words_extraction": "fwe",
}
# RULER's generation budgets per task.
MAX_NEW_TOKENS = {**{t: 128 for t in niah.TASKS}, "vt": 30, "cwe": 120, "fwe": 50}


def resolve_task(task: str) -> str:
    """The canonical name of ``task`` (an alias maps to its task); ValueError when unknown."""
    if isinstance(task, str) and task in TASKS:
        return task
    if isinstance(task, str) and task in TASK_ALIASES:
        return TASK_ALIASES[task]
    raise ValueError(f"unknown task {task!r}: must be one of {list(TASKS)} "
                     f"(or an alias: {sorted(TASK_ALIASES)})")


def generate_samples(tokenizer, task: str, num_samples: int, input_len: int, seed: int = 0) -> list[dict]:
    """``num_samples`` prompts of ``task``, each exactly ``input_len`` token ids long.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (the model's).
        task: a name of :data:`TASKS` (or an alias of :data:`TASK_ALIASES`).
        num_samples: how many samples (>= 0).
        input_len: exact prompt length in tokens, chat template and answer prefix included.
        seed: samples depend only on (task, seed, sample index) and the tokenizer.

    Returns:
        ``[{"task", "input_ids": list[int], "answers": list[str], "max_new_tokens": int}]``.

    Raises:
        ValueError: unknown task, bad num_samples, or input_len below what the task's template,
            needles/question and minimal context need (the message names both numbers).
    """
    name = resolve_task(task)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise ValueError(f"num_samples must be a non-negative integer, got {num_samples!r}")
    if isinstance(input_len, bool) or not isinstance(input_len, int) or input_len < 1:
        raise ValueError(f"input_len must be a positive integer, got {input_len!r}")
    build = _BUILDERS[name]
    tok = Tok(tokenizer)
    samples = []
    for i in range(num_samples):
        rng = random.Random(f"ruler:{name}:{seed}:{i}")
        try:
            ids, answers = build(tok, rng, input_len)
        except TooSmall as err:
            raise ValueError(f"input_len={input_len} is too small for task {name!r}: sample {i} "
                             f"needs at least {err.need} tokens (template, question and minimal "
                             f"context)") from None
        if len(ids) != input_len:  # pragma: no cover - arithmetic guard
            raise RuntimeError(f"built {len(ids)} tokens for {name}, wanted {input_len}")
        samples.append({"task": name, "input_ids": ids, "answers": answers,
                        "max_new_tokens": MAX_NEW_TOKENS[name]})
    return samples


def _postprocess(text: str) -> str:
    return re.sub(r"[\x00-\x1f]", "\n", text).strip()


def string_match_all(output_text: str, answers: list[str]) -> float:
    """RULER's ``string_match_all`` for one sample: the fraction of ``answers`` contained in the
    output (case-insensitive), in [0, 1]."""
    pred = _postprocess(output_text).lower()
    return sum(a.lower() in pred for a in answers) / len(answers) if answers else 0.0


def score(task: str, output_text: str, answers: list[str]) -> float:
    """Score of one output in [0, 1]: all-reference recall (``string_match_all``) for every task
    of :data:`TASKS`. Raises ValueError for an unknown task."""
    resolve_task(task)
    return string_match_all(output_text, list(answers))

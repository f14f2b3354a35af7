"""Needle-in-a-haystack tasks (RULER ``niah``, scripts/data/synthetic/niah.py).

A needle reads "One of the special magic {type_v} for {key} is: {value}."; the haystack is
RULER's noise sentence, essay-like filler, or (``needle``) distractor needles, each with a key
of its own, filling the whole context. The question asks for the values of ``num_q`` of the
``num_k`` keys.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from .haystack import Frame, Tok, split_template
from .words import NUM_DISTINCT, distinct, essay_units, noise_units, random_value

TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the {type_v} afterwards.\n{context}\nWhat are "
            "all the special magic {type_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = "The special magic {type_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."


class NiahSpec(NamedTuple):
    """RULER's niah arguments: haystack ("noise", "essay" or "needle"), key and value types
    ("numbers", "words" or "uuids"), keys, values per key, and queried keys."""

    haystack: str
    type_k: str
    type_v: str
    num_k: int
    num_v: int
    num_q: int


TASKS = {
    "niah_single_numbers": NiahSpec("noise", "words", "numbers", 1, 1, 1),
    "niah_single_essay_numbers": NiahSpec("essay", "words", "numbers", 1, 1, 1),
    "niah_single_uuids": NiahSpec("essay", "words", "uuids", 1, 1, 1),
    "niah_single_words": NiahSpec("essay", "words", "words", 1, 1, 1),
    "niah_multikey": NiahSpec("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_needles": NiahSpec("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_uuids": NiahSpec("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", 4, 1, 4),
}
DEPTHS = sorted({round(100 * i / 39) for i in range(40)})  # RULER: linspace(0, 100, 40)


def needle_units(rng: random.Random, spec: NiahSpec, keys: list[str], values: list[str]):
    """Endless distractor needles (RULER's "needle" haystack): each has a fresh key, distinct
    from ``keys`` and from every earlier distractor's, and a value that is none of ``values``.

    Raises ValueError once all distinct keys of ``spec.type_k`` are used.
    """
    taken_keys, taken_values = set(keys), set(values)
    while True:
        if len(taken_keys) >= NUM_DISTINCT[spec.type_k]:
            raise ValueError(f"the needle haystack used all {NUM_DISTINCT[spec.type_k]} distinct "
                             f"{spec.type_k} keys: input_len is too large for this task")
        key = random_value(rng, spec.type_k)
        if key in taken_keys:
            continue
        taken_keys.add(key)
        value = random_value(rng, spec.type_v)
        while value in taken_values:
            value = random_value(rng, spec.type_v)
        yield NEEDLE.format(type_v=spec.type_v, key=key, value=value)


def build(tok: Tok, rng: random.Random, input_len: int, spec: NiahSpec) -> tuple[list[int], list[str]]:
    """One sample of ``input_len`` ids and its answers (the queried keys' values)."""
    keys = distinct(rng, spec.num_k, lambda r: random_value(r, spec.type_k))
    values = [distinct(rng, spec.num_v, lambda r: random_value(r, spec.type_v)) for _ in keys]
    needles = [NEEDLE.format(type_v=spec.type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    queried = rng.sample(range(spec.num_k), spec.num_q)
    queries = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    head, tail = split_template(TEMPLATE, type_v=spec.type_v, query=query)
    frame = Frame(tok, head, tail, ANSWER_PREFIX.format(type_v=spec.type_v, query=query))
    if spec.haystack == "needle":  # RULER: uniformly random places among the distractors
        fracs = sorted(rng.random() for _ in needles)
        units, sep = needle_units(rng, spec, keys, [v for vs in values for v in vs]), "\n"
    else:
        fracs = sorted(d / 100 for d in rng.sample(DEPTHS, len(needles)))
        units, sep = (noise_units(), "\n") if spec.haystack == "noise" else (essay_units(rng), " ")
    return frame.fill(tok, input_len, units, sep, needles, fracs), answers

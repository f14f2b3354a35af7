"""Variable tracking (RULER ``vt``, scripts/data/synthetic/variable_tracking.py): a chain
``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in RULER's noise sentences; the answer is every
variable that holds the value. From :data:`ICL_MIN_INPUT_LEN` on, RULER's in-context example
(3-letter names, 5 noise sentences) comes first.
"""

from __future__ import annotations

import random

from .haystack import ICL_MIN_INPUT_LEN, Frame, Tok, split_template
from .words import NOISE, distinct, noise_units

TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following "
            "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
            "{query} in the text above.")
ANSWER_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                 "variables are assigned the value {query}, they are:")
NUM_HOPS = 4


def _chain(rng: random.Random, num_hops: int, name_len: int) -> tuple[list[str], list[str], str]:
    """Variable names, the chain's statements and the value."""
    forbidden = (NOISE + TEMPLATE + ANSWER_PREFIX).lower()
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = distinct(rng, num_hops + 1, lambda r: "".join(r.choice(letters) for _ in range(name_len)))
    names = [n if n.lower() not in forbidden else n[::-1] for n in names]
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}."
                                              for j in range(num_hops)]
    return names, chain, value


def _example(names, chain, value, rng, num_noise: int) -> str:
    """A whole ICL example (task text, answer prefix and answer) with ``num_noise`` noise units."""
    units = [NOISE] * num_noise
    positions = sorted(rng.sample(range(num_noise + 1), len(chain))) if num_noise + 1 >= len(chain) \
        else sorted(rng.choices(range(num_noise + 1), k=len(chain)))
    for j, (pos, stmt) in enumerate(zip(positions, chain)):
        units.insert(pos + j, stmt)
    body = TEMPLATE.format(context="\n".join(units), query=value)
    answer = ANSWER_PREFIX.format(num_v=len(names), query=value)
    return f"{body}\n{answer} {' '.join(names)}\n\n"


def build(tok: Tok, rng: random.Random, input_len: int) -> tuple[list[int], list[str]]:
    """One sample of ``input_len`` ids and its answers (the chain's variable names)."""
    icl = ""
    if input_len >= ICL_MIN_INPUT_LEN:
        names, chain, value = _chain(rng, NUM_HOPS, 3)
        icl = _example(names, chain, value, rng, 5)
    names, chain, value = _chain(rng, NUM_HOPS, 5)
    while any(n in icl for n in names) or value in icl:
        names, chain, value = _chain(rng, NUM_HOPS, 5)
    head, tail = split_template(TEMPLATE, query=value)
    frame = Frame(tok, icl + head, tail, ANSWER_PREFIX.format(num_v=len(names), query=value))
    fracs = sorted(rng.random() for _ in chain)
    return frame.fill(tok, input_len, noise_units(), "\n", chain, fracs), names

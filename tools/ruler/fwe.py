"""Frequent-words extraction (RULER ``fwe``, scripts/data/synthetic/freq_words_extraction.py):
coded 6-letter words drawn from a Zipf (alpha 2) law over a 2,000-word vocabulary whose top word
is the noise word ``...``; the answer is the 3 most frequent coded words.

Exact length: word counts are the Zipf law's at the largest total that fits, then ``...``
(which the prompt tells the model to ignore) pads at random places.
"""

from __future__ import annotations

import math
import random

from .haystack import Frame, Tok, TooSmall, split_template

TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find "
            "the three most frequently appeared coded words. {context}\nQuestion: Do not "
            "provide any explanation. Please ignore the dots '....'. What are the three most "
            "frequently appeared words in the above coded text?")
ANSWER_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
VOCAB_SIZE, WORD_LEN, ALPHA = 2000, 6, 2.0


def build(tok: Tok, rng: random.Random, input_len: int):
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = sorted(set("".join(rng.choice(letters) for _ in range(WORD_LEN))
                       for _ in range(VOCAB_SIZE)))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the top-ranked word is noise (RULER)
    answers = vocab[1:4]
    head, tail = split_template(TEMPLATE)
    head = head.rstrip(" ")  # every coded word carries its leading space
    frame = Frame(tok, head, tail, ANSWER_PREFIX)
    budget = frame.budget(input_len)
    wlen = [len(x) for x in tok.many([" " + w for w in vocab])]
    zeta = math.pi ** 2 / 6  # zeta(alpha) for alpha = 2
    weights = [k ** -ALPHA / zeta for k in range(1, len(vocab) + 1)]

    def counts(n: int) -> list[int]:
        return [int(n * w) for w in weights]

    def cost(n: int) -> int:
        return sum(c * l for c, l in zip(counts(n), wlen))

    # The smallest word count whose top 4 coded words have strictly decreasing counts.
    n_min = next(n for n in range(10, 10**6) if (lambda c: c[1] > c[2] > c[3] > c[4] > 0)(counts(n)))
    if cost(n_min) > budget:
        raise TooSmall(input_len - budget + cost(n_min))
    lo, hi = n_min, n_min
    while cost(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid) <= budget:
            lo = mid
        else:
            hi = mid
    words = [w for w, c in zip(vocab, counts(lo)) for _ in range(c)]
    rng.shuffle(words)
    dots = tok(" ...")
    ids_per = dict(zip(vocab, tok.many([" " + w for w in vocab])))
    pieces = [ids_per[w] for w in words]
    for _ in range(budget - cost(lo)):  # pad with the noise word, at random places
        pieces.insert(rng.randint(0, len(pieces)), dots if len(dots) == 1 else tok("\n"))
    context = [t for p in pieces for t in p]
    if len(context) != budget:  # pragma: no cover - arithmetic guard
        raise RuntimeError(f"fwe context of {len(context)} tokens, wanted {budget}")
    return frame.ids(context), answers

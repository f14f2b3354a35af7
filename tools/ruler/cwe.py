"""Common-words extraction (RULER ``cwe``, scripts/data/synthetic/common_words_extraction.py):
a numbered list of words in which 10 words appear ``freq_c`` times and the others ``freq_u``
times (30 / 3, or 6 / 1 below 4,096 tokens, as RULER's settings for short and long prompts);
the answer is the 10 common words. From :data:`ICL_MIN_INPUT_LEN` on, RULER's in-context
example comes first.

Exact length: after the repeated words, single-occurrence words whose token counts make up the
remainder (newlines only near the minimum length).
"""

from __future__ import annotations

import random

from .haystack import ICL_MIN_INPUT_LEN, Frame, Tok, TooSmall, split_template
from .words import LIST_WORDS

TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than "
            "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are "
            "the 10 most common words in the above list?")
ANSWER_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
NUM_COMMON = 10
SINGLE_MAX_TOKENS = 6  # longest single-occurrence filler word, in tokens


def _pseudo_words(rng: random.Random, avoid: list[str]):
    """Endless fresh pronounceable pseudo-words (lowercase), none containing a word of ``avoid``."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    seen = set(LIST_WORDS)
    while True:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(2, 5)))
        if rng.random() < 0.5:
            w += rng.choice(cons)
        if w not in seen and not any(a in w for a in avoid):
            seen.add(w)
            yield w


def _items(tok: Tok, words: list[str]) -> list[int]:
    """'1. w1 2. w2 ...' as ids (numbers and words tokenized separately)."""
    nums = tok.many(["1."] + [f" {i}." for i in range(2, len(words) + 1)])
    wids = tok.many([" " + w for w in words])
    return [t for n, w in zip(nums, wids) for t in n + w]


def build(tok: Tok, rng: random.Random, input_len: int):
    small = input_len < 4096  # RULER's settings for short and long prompts
    freq_c, freq_u = (6, 1) if small else (30, 3)
    pool = list(LIST_WORDS)
    rng.shuffle(pool)
    common, pool = pool[:NUM_COMMON], pool[NUM_COMMON:]
    icl = ""
    if input_len >= ICL_MIN_INPUT_LEN:
        n_words, fc, fu = (20, 3, 1) if small else (40, 10, 3)
        ex_common, ex_uncommon, pool = pool[:10], pool[10:n_words], pool[n_words:]
        ex_list = ex_common * fc + ex_uncommon * fu
        rng.shuffle(ex_list)
        ex_ctx = " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_list))
        ex_answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common))
        icl = f"{TEMPLATE.format(context=ex_ctx)}\n{ANSWER_PREFIX} {ex_answer}\n\n"
    head, tail = split_template(TEMPLATE)
    frame = Frame(tok, icl + head, tail, ANSWER_PREFIX)
    budget = frame.budget(input_len)

    def num_cost(n: int) -> list[int]:
        return [len(x) for x in tok.many(["1."] + [f" {i}." for i in range(2, n + 1)])]

    n_common_items = NUM_COMMON * freq_c
    common_cost = sum(num_cost(n_common_items)) + freq_c * sum(len(tok(" " + w)) for w in common)
    if common_cost > budget:
        raise TooSmall(input_len - budget + common_cost)
    # Uncommon words: the real words left, then pseudo-words, as many as the budget allows.
    max_items = max(budget // 2, n_common_items) + 8
    ncost = num_cost(max_items)
    cum_num = [0]
    for c in ncost:
        cum_num.append(cum_num[-1] + c)
    max_u = max(0, (max_items - n_common_items) // freq_u)
    gen = _pseudo_words(rng, common)
    uncommon = pool[:max_u] + [next(gen) for _ in range(max(0, max_u - len(pool)))]
    ulen = [len(x) for x in tok.many([" " + w for w in uncommon])]
    cum_u = [0]
    for c in ulen:
        cum_u.append(cum_u[-1] + c)
    reserve = 2 * (max(ncost) + 1)  # keep room for two single-occurrence items

    def cost(u: int) -> int:
        n = n_common_items + u * freq_u
        return common_cost - cum_num[n_common_items] + cum_num[n] + freq_u * cum_u[u]

    u = 0
    if cost(0) <= budget - reserve:  # largest u with cost(u) <= budget - reserve (monotone)
        lo, hi = 0, max_u
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid) <= budget - reserve:
                lo = mid
            else:
                hi = mid - 1
        u = lo
    words = common * freq_c + uncommon[:u] * freq_u
    # Single-occurrence fillers whose token counts make up the rest exactly.
    remaining = budget - cost(u)
    by_len: dict[int, list[str]] = {}
    fresh = iter(uncommon[u:] + pool[max_u:])

    def word_of_len(n: int) -> str | None:
        for _ in range(400):
            if by_len.get(n):
                return by_len[n].pop()
            w = next(fresh, None) or next(gen)
            by_len.setdefault(len(tok(" " + w)), []).append(w)
        return None

    singles: list[str] = []
    n_items = len(words)
    # m single items cost their numbers plus 1..LMAX word tokens each: take the smallest m
    # whose range holds `remaining` and spread the word tokens evenly.
    num_costs: list[int] = []
    plan = None
    while remaining > 0 and sum(num_costs) + len(num_costs) <= remaining:
        num_costs.append(len(tok(f" {n_items + len(num_costs) + 1}." if n_items + len(num_costs)
                                 else "1.")))
        m, word_tokens = len(num_costs), remaining - sum(num_costs)
        if m <= word_tokens <= SINGLE_MAX_TOKENS * m:
            plan = [word_tokens // m + (j < word_tokens % m) for j in range(m)]
            break
    for j, length in enumerate(plan or []):
        w = word_of_len(length)
        while w is None and length > 1:  # no such word: a shorter one, newlines make up the rest
            length -= 1
            w = word_of_len(length)
        if w is None:
            break
        singles.append(w)
        remaining -= num_costs[j] + length
    words += singles
    rng.shuffle(words)
    context = _items(tok, words)
    pad = tok("\n")
    if len(context) < budget and len(pad) == 1:  # only near the minimum length: newlines
        context += pad * (budget - len(context))
    if len(context) != budget:  # pragma: no cover - arithmetic guard
        raise RuntimeError(f"cwe context of {len(context)} tokens, wanted {budget}")
    return frame.ids(context), list(common)

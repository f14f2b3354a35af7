"""RULER-style synthetic long-context tasks, each prompt built to an exact token length.

After Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?" (2024). Nothing is downloaded: word lists are in this module, and the essay-like
filler, pseudo-words, keys and values are generated from a seeded ``random.Random``.

Tasks (:data:`TASKS`; RULER's own names are accepted as aliases, see :data:`TASK_ALIASES`):

==========================  ==============================================================
``niah_single_numbers``     one needle in the repeated "The grass is green..." noise; value a
                            7-digit number (RULER ``niah_single_1``)
``niah_single_words``       one needle in essay filler; value a word ("adjective-noun")
``niah_single_uuids``       one needle in essay filler; value a UUID (RULER ``niah_single_3``)
``niah_multikey``           4 needles with different keys, one queried (3 distractors)
``niah_multivalue``         4 needles with the same key; all 4 values are asked for
``niah_multiquery``         4 needles with different keys; all 4 keys are queried
``vt``                      variable tracking: a 4-hop chain ``VAR A = 12345``, ``VAR B = VAR
                            A``, ... hidden in noise; name every variable holding the value
``cwe``                     common-words extraction: a numbered word list, name the 10 most
                            frequent words
``fwe``                     frequent-words extraction: coded words drawn from a Zipf (alpha 2)
                            law, name the 3 most frequent ones
==========================  ==============================================================

Prompts use RULER's task templates and answer prefixes: the task text is one user message,
chat-templated with the model's tokenizer and a generation prompt, and the assistant turn
already starts with the task's answer prefix (e.g. "The special magic numbers for X mentioned
in the provided text are"), as RULER appends it after the model template. ``vt`` and ``cwe``
carry RULER's one in-context example when ``input_len >= ICL_MIN_INPUT_LEN``.

Exact lengths: the prompt is assembled from separately tokenized pieces (chat-template prefix,
task text, context, question, template suffix, answer prefix). The needle/vt haystacks are
cut at the token level right before the question (needles and chain statements always sit in
whole filler units); ``cwe`` adds single-occurrence words whose token counts make up the
remainder; ``fwe`` pads with the noise word ``...`` that the prompt tells the model to ignore.

Scoring (:func:`score`) is RULER's ``string_match_all``: the fraction of reference strings
contained in the output, case-insensitive, after control characters become newlines.
"""

from __future__ import annotations

import math
import random
import re
import uuid

from nanovllm.utils.passkey import _encode, _template_halves

__all__ = [
    "TASKS",
    "TASK_ALIASES",
    "MAX_NEW_TOKENS",
    "ICL_MIN_INPUT_LEN",
    "resolve_task",
    "generate_samples",
    "score",
    "string_match_all",
    "string_match_part",
]

TASKS = (
    "niah_single_numbers",
    "niah_single_words",
    "niah_single_uuids",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)
TASK_ALIASES = {
    "niah_single": "niah_single_numbers",
    "niah_single_1": "niah_single_numbers",
    "niah_single_3": "niah_single_uuids",
    "niah_multikey_1": "niah_multikey",
    "variable_tracking": "vt",
    "common_words_extraction": "cwe",
    "freq_words_extraction": "fwe",
}
# RULER's generation budgets per task.
MAX_NEW_TOKENS = {**{t: 128 for t in TASKS if t.startswith("niah")}, "vt": 30, "cwe": 120, "fwe": 50}
# vt and cwe prepend RULER's in-context example only from this prompt length on (below it the
# example would leave too little room for the task itself).
ICL_MIN_INPUT_LEN = 1024

# ---- word lists --------------------------------------------------------------------------
_ADJECTIVES = """
able ancient angry bitter black bold brave bright broad calm careful cheap clean clever
cold cool crazy cruel curious damp dark dear deep dense dry dull eager early easy empty
equal fair famous fancy fast fierce fine firm flat fresh friendly funny gentle giant glad
golden good grand great green happy hard harsh heavy hollow honest huge humble hungry
jolly kind large late lazy light little lively lonely long loud lucky mighty modern narrow
neat nervous noble noisy odd old pale patient plain polite poor proud quick quiet rapid
rare raw red rich rough round royal rude sad safe scarce sharp shiny short shy silent
silly simple slim slow small smart smooth soft solid sour spicy steady steep sticky stiff
strange strict strong sunny sweet swift tall tame tender thick thin tidy tiny tough ugly
vast violet warm weak wet white wide wild wise witty young yellow zealous
""".split()
_NOUNS = """
actor airport anchor animal answer apple arch area army arrow artist author autumn baby
badge bakery balance ball band bank barn basket beach bean bear bed bell bench bicycle
bird blanket boat bone book border bottle bowl box branch bread bridge brother brush
bucket building butter button cabin cable cake camera camp candle canal canvas captain
car card carpet castle cat cave chain chair chalk channel cheese chest child church
circle city cliff clock cloud coast coat coffee coin comet compass cook corner cotton
country cousin cow crane crowd crown cup curtain cushion daisy dancer desert desk diamond
doctor dog dolphin door dragon drawer dream drum eagle earth engine envelope factory
falcon farm feather fence field finger fire fish flag flame flower forest fountain fox
friend frog garden gate giraffe glass globe glove goat grape guitar hammer harbor hat
helmet hill horse hospital hotel house island jacket jewel journal jungle kettle key king
kitchen kite ladder lake lamp lantern leaf lemon letter library lion lizard lock machine
map market meadow melon mirror monkey moon mountain museum needle nest ocean office
orange orchard owl painter palace paper parrot path pencil piano picture pilot planet
plate pocket poet pond queen rabbit radio rainbow river road robot rocket roof rope sail
sailor salad school scissors sea shadow sheep shell ship shirt shoe shop singer sister
sky snake soldier spoon square stamp star station statue stone storm stove street sugar
sun table teacher temple tent thunder ticket tiger tower town toy tractor train tree
truck tunnel turtle umbrella valley vase village violin volcano wagon wall wallet whale
wheel window winter wolf wood world zebra
""".split()
_VERBS = """
admired answered borrowed built carried chased cleaned climbed collected copied counted
covered crossed described designed discovered divided drew explored filled followed found
gathered guarded helped hid imagined improved joined kept lifted lost measured mended
moved noticed opened ordered painted passed photographed planted polished prepared
pulled pushed raised reached read remembered repaired rescued returned saved searched
shared showed studied supported tested touched traded trusted understood visited washed
watched welcomed wrote
""".split()
_ADVERBS = """
again almost always boldly briefly calmly carefully clearly eagerly easily finally gently
gladly happily honestly kindly loudly nearly neatly never often openly patiently politely
quickly quietly rarely really seldom simply slowly softly soon suddenly surely swiftly
today together warmly wisely
""".split()
_PREPOSITIONS = "above across after along around behind below beside beyond near over under".split()


def _substring_free(words: list[str]) -> list[str]:
    """Unique words, none of which is a substring of another (so a containment check of one
    word never credits another)."""
    uniq = sorted(set(words))
    return [w for w in uniq if not any(w != o and w in o for o in uniq)]


# Words of cwe's lists and answers: no word contains another.
_LIST_WORDS = _substring_free(_NOUNS + _ADJECTIVES + _VERBS)

_ESSAY_TEMPLATES = (
    "The {adj} {noun} {verb} the {noun2} {prep} the {adj2} {noun3}.",
    "{Adv}, the {noun} {verb} every {adj} {noun2}.",
    "When the {noun} {verb} the {noun2}, the {adj} {noun3} {verb2} it {adv}.",
    "It is {adj} that the {noun} {verb} the {noun2} {adv}.",
    "One {adj} {noun} {verb} the {noun2} and the {noun3}.",
    "Nobody {verb} the {adj} {noun} {prep} the {noun2}.",
    "Perhaps the {noun} {verb} the {noun2} because the {noun3} was {adj}.",
    "In the {adj} {noun}, a {noun2} {verb} the {adj2} {noun3} {adv}.",
    "The {noun} was {adj}, and the {noun2} was {adj2}.",
    "Every {noun} {verb} some {adj} {noun2} {prep} the {noun3}.",
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# ---- RULER templates -----------------------------------------------------------------------
_NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to "
                  "memorize it. I will quiz you about the {type_v} afterwards.\n{context}\nWhat are "
                  "all the special magic {type_v} for {query} mentioned in the provided text?")
_NIAH_ANSWER = "The special magic {type_v} for {query} mentioned in the provided text are"
_NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
_VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following "
                "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
                "{query} in the text above.")
_VT_ANSWER = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
              "variables are assigned the value {query}, they are:")
_CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than "
                 "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are "
                 "the 10 most common words in the above list?")
_CWE_ANSWER = "Answer: The top 10 words that appear most often in the list are:"
_FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find "
                 "the three most frequently appeared coded words. {context}\nQuestion: Do not "
                 "provide any explanation. Please ignore the dots '....'. What are the three most "
                 "frequently appeared words in the above coded text?")
_FWE_ANSWER = "Answer: According to the coded text above, the three most frequently appeared words are:"

_NIAH = {  # haystack, needle-value type, keys, values per key, queried keys
    "niah_single_numbers": ("noise", "numbers", 1, 1, 1),
    "niah_single_words": ("essay", "words", 1, 1, 1),
    "niah_single_uuids": ("essay", "uuids", 1, 1, 1),
    "niah_multikey": ("essay", "numbers", 4, 1, 1),
    "niah_multivalue": ("essay", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "numbers", 4, 1, 4),
}
_DEPTHS = sorted({round(100 * i / 39) for i in range(40)})  # RULER: linspace(0, 100, 40)
_VT_HOPS, _VT_CHAINS = 4, 1
_CWE_NUM_COMMON = 10
_CWE_SINGLE_MAX_TOKENS = 6  # longest single-occurrence filler word, in tokens
_FWE_VOCAB, _FWE_WORD_LEN, _FWE_ALPHA = 2000, 6, 2.0


class _TooSmall(Exception):
    def __init__(self, need: int):
        self.need = need


def resolve_task(task: str) -> str:
    """The canonical name of ``task`` (an alias maps to its task); ValueError when unknown."""
    if isinstance(task, str) and task in TASKS:
        return task
    if isinstance(task, str) and task in TASK_ALIASES:
        return TASK_ALIASES[task]
    raise ValueError(f"unknown task {task!r}: must be one of {list(TASKS)} "
                     f"(or an alias: {sorted(TASK_ALIASES)})")


# ---- token-level building blocks ---------------------------------------------------------
class _Tok:
    """Tokenizer wrapper with a cache and batch encoding (no special tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = self.cache[text] = _encode(self.tokenizer, text)
        return ids

    def many(self, texts: list[str]) -> list[list[int]]:
        todo = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if todo:
            enc = self.tokenizer(todo, add_special_tokens=False)["input_ids"]
            self.cache.update(zip(todo, (list(e) for e in enc)))
        return [self.cache[t] for t in texts]


def _haystack(tok: _Tok, units, sep: str, inserts: list[str], fracs: list[float],
              budget: int) -> list[int]:
    """Exactly ``budget`` ids: filler ``units`` (an endless iterator of strings, joined by
    ``sep``) with ``inserts`` placed, in order, between whole units at the relative depths
    ``fracs`` (sorted, in [0, 1]); the last filler unit is cut to make the length exact.

    Raises _TooSmall when the inserts alone exceed ``budget``.
    """
    ins_ids = tok.many([sep + s for s in inserts])
    fill = budget - sum(map(len, ins_ids))
    if fill < 0:
        raise _TooSmall(budget - fill)
    unit_texts: list[str] = []
    unit_ids: list[list[int]] = []
    total = 0

    def more(until: int):
        nonlocal total
        while total < until:
            batch = [next(units) for _ in range(32)]
            for text, ids in zip(batch, tok.many([sep + u for u in batch])):
                unit_texts.append(text)
                unit_ids.append(ids)
                total += len(ids)

    more(fill + 8)  # a few spare tokens: the first piece is tokenized without `sep`
    # Whole units that surely fit before the cut (the same margin).
    cum, whole = 0, 0
    for ids in unit_ids:
        if cum + len(ids) > fill - 4:
            break
        cum += len(ids)
        whole += 1
    positions = [min(whole, int(f * whole + 0.5)) for f in fracs]
    out: list[int] = []
    inserts_end = 0
    k = 0
    for u in range(len(unit_texts) + 1):
        while k < len(inserts) and positions[k] == u:
            out += tok(inserts[k]) if not out else ins_ids[k]
            inserts_end = len(out)
            k += 1
        if u < len(unit_texts):
            out += tok(unit_texts[u]) if not out else unit_ids[u]
    while len(out) < budget:  # pragma: no cover - only if the first piece shrank a lot
        n = len(unit_ids)
        more(total + budget - len(out))
        out += [t for ids in unit_ids[n:] for t in ids]
    if inserts_end > budget:  # pragma: no cover - arithmetic guard
        raise RuntimeError("an insert fell outside the haystack")
    return out[:budget]


def _noise_units():
    while True:
        yield NOISE


def _essay_units(rng: random.Random):
    """Endless essay-like sentences (no digits, no hyphens)."""
    while True:
        t = rng.choice(_ESSAY_TEMPLATES)
        adv = rng.choice(_ADVERBS)
        yield t.format(adj=rng.choice(_ADJECTIVES), adj2=rng.choice(_ADJECTIVES),
                       noun=rng.choice(_NOUNS), noun2=rng.choice(_NOUNS), noun3=rng.choice(_NOUNS),
                       verb=rng.choice(_VERBS), verb2=rng.choice(_VERBS), adv=adv,
                       Adv=adv.capitalize(), prep=rng.choice(_PREPOSITIONS))


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _random_value(rng: random.Random, type_v: str) -> str:
    if type_v == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if type_v == "words":
        return _word_key(rng)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(rng: random.Random, n: int, draw) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = draw(rng)
        if v not in out:
            out.append(v)
    return out


class _Frame:
    """Chat-template prefix + user text (head, context, tail) + template suffix + answer prefix."""

    def __init__(self, tok: _Tok, head: str, tail: str, answer_prefix: str):
        prefix, suffix = _template_halves(tok.tokenizer, None)
        self.before = tok(prefix) + tok(head)
        self.after = tok(tail) + tok(suffix) + tok(answer_prefix)

    def budget(self, input_len: int) -> int:
        return input_len - len(self.before) - len(self.after)

    def ids(self, context: list[int]) -> list[int]:
        return self.before + context + self.after


def _split(template: str, **fmt) -> tuple[str, str]:
    head, tail = template.format(context="\0", **fmt).split("\0")
    return head, tail


# ---- tasks -------------------------------------------------------------------------------
def _niah(tok: _Tok, task: str, rng: random.Random, input_len: int):
    haystack, type_v, num_k, num_v, num_q = _NIAH[task]
    keys = _distinct(rng, num_k, _word_key)
    values = [_distinct(rng, num_v, lambda r: _random_value(r, type_v)) for _ in keys]
    needles = [_NIAH_NEEDLE.format(type_v=type_v, key=k, value=v)
               for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    queried = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    head, tail = _split(_NIAH_TEMPLATE, type_v=type_v, query=query)
    frame = _Frame(tok, head, tail, _NIAH_ANSWER.format(type_v=type_v, query=query))
    fracs = sorted(d / 100 for d in rng.sample(_DEPTHS, len(needles)))
    units, sep = (_noise_units(), "\n") if haystack == "noise" else (_essay_units(rng), " ")
    budget = frame.budget(input_len)
    try:
        context = _haystack(tok, units, sep, needles, fracs, max(budget, 0))
    except _TooSmall as e:
        raise _TooSmall(input_len - budget + e.need) from None
    return frame.ids(context), answers


def _vt_chain(rng: random.Random, num_hops: int, name_len: int) -> tuple[list[str], list[str], str]:
    forbidden = (NOISE + _VT_TEMPLATE + _VT_ANSWER).lower()
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = _distinct(rng, num_hops + 1, lambda r: "".join(r.choice(letters) for _ in range(name_len)))
    names = [n if n.lower() not in forbidden else n[::-1] for n in names]
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}."
                                              for j in range(num_hops)]
    return names, chain, value


def _vt_text(names, chain, value, rng, num_noise: int) -> str:
    """A whole ICL example (task text, answer prefix and answer) with ``num_noise`` noise units."""
    units = [NOISE] * num_noise
    positions = sorted(rng.sample(range(num_noise + 1), len(chain))) if num_noise + 1 >= len(chain) \
        else sorted(rng.choices(range(num_noise + 1), k=len(chain)))
    for j, (pos, stmt) in enumerate(zip(positions, chain)):
        units.insert(pos + j, stmt)
    body = _VT_TEMPLATE.format(context="\n".join(units), query=value)
    answer = _VT_ANSWER.format(num_v=len(names), query=value)
    return f"{body}\n{answer} {' '.join(names)}\n\n"


def _vt(tok: _Tok, rng: random.Random, input_len: int):
    icl = ""
    if input_len >= ICL_MIN_INPUT_LEN:  # RULER's example: 3-letter names, 5 noise units
        names, chain, value = _vt_chain(rng, _VT_HOPS, 3)
        icl = _vt_text(names, chain, value, rng, 5)
    names, chain, value = _vt_chain(rng, _VT_HOPS, 5)
    while any(n in icl for n in names) or value in icl:
        names, chain, value = _vt_chain(rng, _VT_HOPS, 5)
    head, tail = _split(_VT_TEMPLATE, query=value)
    frame = _Frame(tok, icl + head, tail, _VT_ANSWER.format(num_v=len(names), query=value))
    fracs = sorted(rng.random() for _ in chain)
    budget = frame.budget(input_len)
    try:
        context = _haystack(tok, _noise_units(), "\n", chain, fracs, max(budget, 0))
    except _TooSmall as e:
        raise _TooSmall(input_len - budget + e.need) from None
    return frame.ids(context), names


def _pseudo_words(rng: random.Random, avoid: list[str]):
    """Endless fresh pronounceable pseudo-words (lowercase), none containing a word of ``avoid``."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    seen = set(_LIST_WORDS)
    while True:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(2, 5)))
        if rng.random() < 0.5:
            w += rng.choice(cons)
        if w not in seen and not any(a in w for a in avoid):
            seen.add(w)
            yield w


def _cwe_items(tok: _Tok, words: list[str]) -> list[int]:
    """'1. w1 2. w2 ...' as ids (numbers and words tokenized separately)."""
    nums = tok.many(["1."] + [f" {i}." for i in range(2, len(words) + 1)])
    wids = tok.many([" " + w for w in words])
    return [t for n, w in zip(nums, wids) for t in n + w]


def _cwe(tok: _Tok, rng: random.Random, input_len: int):
    small = input_len < 4096  # RULER's settings for short and long prompts
    freq_c, freq_u = (6, 1) if small else (30, 3)
    pool = list(_LIST_WORDS)
    rng.shuffle(pool)
    common, pool = pool[:_CWE_NUM_COMMON], pool[_CWE_NUM_COMMON:]
    icl = ""
    if input_len >= ICL_MIN_INPUT_LEN:
        n_words, fc, fu = (20, 3, 1) if small else (40, 10, 3)
        ex_common, ex_uncommon, pool = pool[:10], pool[10:n_words], pool[n_words:]
        ex_list = ex_common * fc + ex_uncommon * fu
        rng.shuffle(ex_list)
        ex_ctx = " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_list))
        ex_answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common))
        icl = f"{_CWE_TEMPLATE.format(context=ex_ctx)}\n{_CWE_ANSWER} {ex_answer}\n\n"
    head, tail = _split(_CWE_TEMPLATE)
    frame = _Frame(tok, icl + head, tail, _CWE_ANSWER)
    budget = frame.budget(input_len)

    def num_cost(n: int) -> list[int]:
        return [len(x) for x in tok.many(["1."] + [f" {i}." for i in range(2, n + 1)])]

    n_common_items = _CWE_NUM_COMMON * freq_c
    common_cost = sum(num_cost(n_common_items)) + freq_c * sum(len(tok(" " + w)) for w in common)
    if common_cost > budget:
        raise _TooSmall(input_len - budget + common_cost)
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
        if m <= word_tokens <= _CWE_SINGLE_MAX_TOKENS * m:
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
    context = _cwe_items(tok, words)
    pad = tok("\n")
    if len(context) < budget and len(pad) == 1:  # only near the minimum length: newlines
        context += pad * (budget - len(context))
    if len(context) != budget:  # pragma: no cover - arithmetic guard
        raise RuntimeError(f"cwe context of {len(context)} tokens, wanted {budget}")
    return frame.ids(context), list(common)


def _fwe(tok: _Tok, rng: random.Random, input_len: int):
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = sorted(set("".join(rng.choice(letters) for _ in range(_FWE_WORD_LEN))
                       for _ in range(_FWE_VOCAB)))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the top-ranked word is noise (RULER)
    answers = vocab[1:4]
    head, tail = _split(_FWE_TEMPLATE)
    head = head.rstrip(" ")  # every coded word carries its leading space
    frame = _Frame(tok, head, tail, _FWE_ANSWER)
    budget = frame.budget(input_len)
    wlen = [len(x) for x in tok.many([" " + w for w in vocab])]
    zeta = math.pi ** 2 / 6  # zeta(alpha) for alpha = 2
    weights = [k ** -_FWE_ALPHA / zeta for k in range(1, len(vocab) + 1)]

    def counts(n: int) -> list[int]:
        return [int(n * w) for w in weights]

    def cost(n: int) -> int:
        return sum(c * l for c, l in zip(counts(n), wlen))

    # The smallest word count whose top 4 coded words have strictly decreasing counts.
    n_min = next(n for n in range(10, 10**6) if (lambda c: c[1] > c[2] > c[3] > c[4] > 0)(counts(n)))
    if cost(n_min) > budget:
        raise _TooSmall(input_len - budget + cost(n_min))
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


# ---- public API --------------------------------------------------------------------------
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
    tok = _Tok(tokenizer)
    samples = []
    for i in range(num_samples):
        rng = random.Random(f"ruler:{name}:{seed}:{i}")
        try:
            if name in _NIAH:
                ids, answers = _niah(tok, name, rng, input_len)
            elif name == "vt":
                ids, answers = _vt(tok, rng, input_len)
            elif name == "cwe":
                ids, answers = _cwe(tok, rng, input_len)
            else:
                ids, answers = _fwe(tok, rng, input_len)
        except _TooSmall as err:
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


def string_match_part(output_text: str, answers: list[str]) -> float:
    """RULER's ``string_match_part`` (QA): 1.0 when any answer is contained in the output."""
    pred = _postprocess(output_text).lower()
    return float(any(a.lower() in pred for a in answers))


def score(task: str, output_text: str, answers: list[str]) -> float:
    """Score of one output in [0, 1]: all-reference recall (``string_match_all``) for every task
    of :data:`TASKS`. Raises ValueError for an unknown task."""
    resolve_task(task)
    return string_match_all(output_text, list(answers))

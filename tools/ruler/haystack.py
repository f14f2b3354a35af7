"""Token-level prompt assembly of the RULER tasks: a caching tokenizer wrapper, the haystack
filled to an exact token budget with inserts at given depths, and the chat-template frame
(template prefix, task text around the context, template suffix, answer prefix).
"""

from __future__ import annotations

from tools.passkey import template_halves

# vt and cwe prepend RULER's in-context example only from this prompt length on (below it the
# example would leave too little room for the task itself).
ICL_MIN_INPUT_LEN = 1024


class TooSmall(Exception):
    """The prompt cannot fit: ``need`` is the smallest length (in tokens) that could."""

    def __init__(self, need: int):
        super().__init__(need)
        self.need = need


class Tok:
    """Tokenizer wrapper with a cache and batch encoding (no special tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = self.cache[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids

    def many(self, texts: list[str]) -> list[list[int]]:
        todo = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if todo:
            enc = self.tokenizer(todo, add_special_tokens=False)["input_ids"]
            self.cache.update(zip(todo, (list(e) for e in enc)))
        return [self.cache[t] for t in texts]


def fill(tok: Tok, units, sep: str, inserts: list[str], fracs: list[float], budget: int) -> list[int]:
    """Exactly ``budget`` ids: filler ``units`` (an endless iterator of strings, joined by
    ``sep``) with ``inserts`` placed, in order, between whole units at the relative depths
    ``fracs`` (sorted, in [0, 1]); the last filler unit is cut to make the length exact.

    Raises TooSmall when the inserts alone exceed ``budget``.
    """
    ins_ids = tok.many([sep + s for s in inserts])
    room = budget - sum(map(len, ins_ids))
    if room < 0:
        raise TooSmall(budget - room)
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

    more(room + 8)  # a few spare tokens: the first piece is tokenized without `sep`
    # Whole units that surely fit before the cut (the same margin).
    cum, whole = 0, 0
    for ids in unit_ids:
        if cum + len(ids) > room - 4:
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


def split_template(template: str, **fmt) -> tuple[str, str]:
    """The task text before and after ``{context}`` in ``template`` (other fields from ``fmt``)."""
    head, tail = template.format(context="\0", **fmt).split("\0")
    return head, tail


class Frame:
    """Chat-template prefix + user text (head, context, tail) + template suffix + answer prefix."""

    def __init__(self, tok: Tok, head: str, tail: str, answer_prefix: str):
        prefix, suffix = template_halves(tok.tokenizer, None)
        self.before = tok(prefix) + tok(head)
        self.after = tok(tail) + tok(suffix) + tok(answer_prefix)

    def budget(self, input_len: int) -> int:
        """Context tokens left in a prompt of ``input_len`` tokens (negative when none)."""
        return input_len - len(self.before) - len(self.after)

    def ids(self, context: list[int]) -> list[int]:
        return self.before + context + self.after

    def fill(self, tok: Tok, input_len: int, units, sep: str, inserts: list[str],
             fracs: list[float]) -> list[int]:
        """The whole prompt of ``input_len`` ids, its context made by :func:`fill`; TooSmall
        (with the whole prompt's minimal length) when the inserts do not fit."""
        budget = self.budget(input_len)
        try:
            context = fill(tok, units, sep, inserts, fracs, max(budget, 0))
        except TooSmall as e:
            raise TooSmall(input_len - budget + e.need) from None
        return self.ids(context)

"""Pass-key ("needle in a haystack") prompts of an exact token length, for tests and tools.

The haystack is the classic filler ("The grass is green. The sky is blue. The sun is yellow.
Here we go. There and back again." repeated), with the needle "The pass key is KEY. Remember
it. KEY is the pass key." inserted at a relative depth, followed by the question "What is the
pass key? Reply with the number only." -- all as one user chat message, chat-templated with a
generation prompt.

The prompt is assembled at the token level (template prefix + filler + needle + filler +
question + template suffix, each tokenized separately) so that it can hit an exact token
count: the filler before the needle ends on a sentence boundary, the filler after it is cut
to whatever token count makes the total exact.
"""

from __future__ import annotations

__all__ = [
    "FILLER_SENTENCES",
    "NEEDLE_TEMPLATE",
    "QUESTION",
    "build_passkey_prompt",
    "chat_prompt_ids",
    "template_halves",
]

FILLER_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
NEEDLE_TEMPLATE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Reply with the number only."

_SENTINEL = "\u2063NANOVLLM_HAYSTACK\u2063"


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def template_halves(tokenizer, system: str | None) -> tuple[str, str]:
    """The chat-template text ``(before, after)`` the user message content, generation prompt
    included (``system``: optional system message). ValueError when the template does not
    render the user content verbatim."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": _SENTINEL})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the tokenizer's chat template does not render the user content verbatim")
    prefix, suffix = text.split(_SENTINEL)
    return prefix, suffix


def chat_prompt_ids(tokenizer, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of one user message, chat-templated with the generation prompt.

    Equivalent to ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)``
    followed by ``encode(add_special_tokens=False)`` (the template already carries the special
    tokens). Returns a plain ``list[int]``.
    """
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user_text})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _encode(tokenizer, text)


def build_passkey_prompt(
    tokenizer,
    target_tokens: int,
    depth: float,
    key: int | str,
    *,
    question: str = QUESTION,
    system: str | None = None,
) -> list[int]:
    """Build a chat-templated pass-key prompt of exactly ``target_tokens`` token ids.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        target_tokens: exact length of the returned list, in tokens.
        depth: where the needle goes, as a fraction of the filler in [0, 1] (0 = first,
            1 = right before the question); it is placed on the nearest sentence boundary.
        key: the pass key (e.g. 58213); the needle reads "The pass key is KEY. Remember it.
            KEY is the pass key."
        question: the question that follows the haystack inside the same user message.
        system: optional system message (default: the template's own default, if any).

    Returns:
        ``list[int]`` of length ``target_tokens``.

    Raises:
        ValueError: ``depth`` outside [0, 1], or ``target_tokens`` smaller than the template,
            needle and question alone need (the message says how many that is).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    prefix, suffix = template_halves(tokenizer, system)
    prefix_ids = _encode(tokenizer, prefix)
    suffix_ids = _encode(tokenizer, suffix)
    needle = NEEDLE_TEMPLATE.format(key=key)
    question_ids = _encode(tokenizer, "\n\n" + question)
    fixed = len(prefix_ids) + len(suffix_ids) + len(question_ids)
    filler_budget = target_tokens - fixed - len(_encode(tokenizer, " " + needle))
    if filler_budget < 0:
        raise ValueError(
            f"target_tokens={target_tokens} is too small: template, needle and question need "
            f"{target_tokens - filler_budget} tokens"
        )

    # Filler as a stream of sentences; sentence i's ids carry a leading space except the first.
    first_ids = [_encode(tokenizer, s) for s in FILLER_SENTENCES]
    cont_ids = [_encode(tokenizer, " " + s) for s in FILLER_SENTENCES]

    def whole_sentences(max_tokens: int) -> list[list[int]]:
        """Whole filler sentences, in order, while their total stays <= max_tokens."""
        out: list[list[int]] = []
        total, i = 0, 0
        while True:
            sent = (first_ids if i == 0 else cont_ids)[i % len(FILLER_SENTENCES)]
            if total + len(sent) > max_tokens:
                return out
            out.append(sent)
            total += len(sent)
            i += 1

    # The needle goes on the sentence boundary nearest to depth * filler_budget.
    target_before = round(depth * filler_budget)
    sents = whole_sentences(filler_budget)
    n_sents, acc, best_err = 0, 0, target_before
    for k, sent in enumerate(sents, start=1):
        acc += len(sent)
        if abs(acc - target_before) < best_err:
            n_sents, best_err = k, abs(acc - target_before)
        elif acc > target_before:
            break
    before = [t for sent in sents[:n_sents] for t in sent]
    # The needle starts the haystack when nothing precedes it (no leading space then).
    needle_ids = _encode(tokenizer, (" " if before else "") + needle)
    remaining = target_tokens - fixed - len(before) - len(needle_ids)
    if remaining < 0:
        raise ValueError(
            f"target_tokens={target_tokens} is too small for depth={depth}: "
            f"{-remaining} tokens over"
        )
    # After the needle the filler continues (leading spaces), cut to make the total exact.
    after = _after_filler(cont_ids, remaining)
    ids = prefix_ids + before + needle_ids + after + question_ids + suffix_ids
    if len(ids) != target_tokens:  # pragma: no cover - arithmetic guard
        raise RuntimeError(f"built {len(ids)} tokens, wanted {target_tokens}")
    return ids


def _after_filler(cont_ids: list[list[int]], n_tokens: int) -> list[int]:
    """Exactly n_tokens of filler, each sentence with a leading space, cut at the end."""
    out: list[int] = []
    i = 0
    while len(out) < n_tokens:
        out.extend(cont_ids[i % len(cont_ids)])
        i += 1
    return out[:n_tokens]

"""The prompt forms ``generate`` takes (vLLM's and nano-vLLM's) and ``chat``'s conversations,
checked and brought to one form before anything is tokenized or queued."""
from typing import NamedTuple

from nanovllm.utils.checks import is_integer

PROMPT_FORMS = "a string, a list of token ids, {'prompt': str} or {'prompt_token_ids': [ids]}"


class Prompt(NamedTuple):
    """One prompt: its ``text`` (None when given as ids) and/or its ``token_ids`` (None when the
    text still has to be tokenized)."""

    text: str | None
    token_ids: list | None


def as_list(value):
    """Arrays and tensors as (nested) Python lists, also as a dict prompt's values; anything else
    unchanged (a list's repr shows every id, an array's elides)."""
    if isinstance(value, dict):
        return {key: as_list(v) for key, v in value.items()}
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def parse_prompt(prompt) -> Prompt:
    """One prompt in any accepted form. A dict with both "prompt" and "prompt_token_ids" runs the
    token ids and reports the text as the output's prompt, as vLLM does.

    Raises:
        ValueError: ``prompt`` has none of the accepted forms; a dict prompt has other keys than
            "prompt" and "prompt_token_ids", or a value of the wrong type (naming the key).
    """
    prompt = as_list(prompt)
    if isinstance(prompt, str):
        return Prompt(prompt, None)
    if isinstance(prompt, (list, tuple)):
        return Prompt(None, list(prompt))
    if isinstance(prompt, dict):
        return _dict_prompt(prompt)
    raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__} "
                     f"(accepted: {PROMPT_FORMS})")


def _dict_prompt(prompt: dict) -> Prompt:
    keys = sorted(prompt, key=str)
    if not keys or not set(keys) <= {"prompt", "prompt_token_ids"}:
        raise ValueError(f"a prompt must be a string or a list of token ids, got a dict with keys {keys} "
                         f"(a dict prompt is {{'prompt': str}} and/or {{'prompt_token_ids': [ids]}}; other "
                         f"keys, e.g. multi-modal data, are not supported)")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if "prompt" in prompt and not isinstance(text, str):
        raise ValueError(f"a dict prompt's 'prompt' must be a string, got {type(text).__name__}")
    if "prompt_token_ids" in prompt and not isinstance(ids, (list, tuple)):
        raise ValueError(f"a dict prompt's 'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}")
    return Prompt(text, None if ids is None else list(ids))


def parse_prompts(prompts) -> list[Prompt]:
    """``generate``'s ``prompts``: one prompt or a list of them (an empty list gives no prompts).

    Raises:
        ValueError: ``prompts`` is neither, naming the argument; or a prompt in it is malformed.
    """
    prompts = as_list(prompts)
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and is_integer(prompts[0])):
        return [parse_prompt(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt ({PROMPT_FORMS}) or a list of prompts, "
                         f"got {type(prompts).__name__}: {prompts!r:.80}")
    return [parse_prompt(p) for p in prompts]


def parse_conversations(messages) -> list[list[dict]]:
    """``chat``'s ``messages``: one conversation (a list of message dicts such as
    ``{"role": "user", "content": "Hi"}``) or a list of conversations.

    Raises:
        ValueError: ``messages`` is neither, naming the argument; a message lacks a string
            ``role`` or ``content``, naming the conversation and message index.
    """
    conversations = messages if isinstance(messages, (list, tuple)) and messages and all(
        isinstance(c, (list, tuple)) for c in messages) else [messages]
    for conversation in conversations:
        if not isinstance(conversation, (list, tuple)) or not conversation or not all(
                isinstance(m, dict) for m in conversation):
            raise ValueError("messages must be a conversation (a non-empty list of message dicts such as "
                             "{'role': 'user', 'content': 'Hi'}) or a list of conversations, "
                             f"got {messages!r:.80}")
    for c, conversation in enumerate(conversations):
        for m, message in enumerate(conversation):
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    raise ValueError(f"messages: conversation {c}, message {m} needs a string {key!r}, "
                                     f"got {message!r:.80}")
    return [list(c) for c in conversations]


CHAT_ARGUMENTS = ("conversation", "chat_template", "tokenize", "add_generation_prompt")
"""``apply_chat_template`` arguments that ``chat`` sets itself."""


def template_kwargs(chat_template_kwargs) -> dict:
    """``chat``'s ``chat_template_kwargs`` (None or a dict of extra chat-template variables,
    vLLM's argument) as keyword arguments of ``apply_chat_template``.

    Raises:
        ValueError: not a dict with string keys, or a key that ``chat`` sets itself
            (:data:`CHAT_ARGUMENTS`).
    """
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict with string keys, got {chat_template_kwargs!r:.80}")
    taken = [k for k in chat_template_kwargs if k in CHAT_ARGUMENTS]
    if taken:
        raise ValueError(f"chat_template_kwargs cannot set {taken}: chat sets them (use its own arguments)")
    return dict(chat_template_kwargs)

"""The prompt forms ``generate`` takes (vLLM's and nano-vLLM's) and ``chat``'s conversations,
checked and brought to one form before anything is tokenized or queued."""
from typing import NamedTuple

from jinja2 import TemplateError

from nanovllm.utils.checks import check_bool, is_integer

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


def check_text(text: str, name: str) -> None:
    """ValueError naming ``name`` when ``text`` is not valid Unicode (a lone surrogate, e.g. from
    a bad decode: no tokenizer can encode it), with the position of the first bad character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} is not valid Unicode: {text[err.start]!r} (a lone surrogate) at character "
                         f"{err.start}; fix the text's decoding (e.g. errors='replace')") from None


def _message_content(content, where: str, keep_parts: bool):
    """A message's content as the template gets it: a string, or OpenAI's text parts
    (``[{"type": "text", "text": ...}]``) joined by newlines (vLLM's "string" format), or kept
    as parts (``keep_parts``: its "openai" format)."""
    if isinstance(content, str):
        check_text(content, where)
        return content
    if not isinstance(content, (list, tuple)) or not all(isinstance(part, dict) for part in content):
        raise ValueError(f"{where} needs a string 'content' or a list of text parts "
                         f"[{{'type': 'text', 'text': ...}}], got {content!r:.80}")
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}, part {j}: only text parts {{'type': 'text', 'text': str}} are supported "
                             f"(no multi-modal input), got {part!r:.80}")
        check_text(part["text"], f"{where}, part {j}")
    return [dict(part) for part in content] if keep_parts else "\n".join(part["text"] for part in content)


def parse_conversations(messages, keep_parts: bool = False) -> list[list[dict]]:
    """``chat``'s ``messages``: one conversation (a list of message dicts such as
    ``{"role": "user", "content": "Hi"}``; content a string or OpenAI text parts) or a list of
    conversations. Returns new message dicts whose content is a string (parts joined by
    newlines) or, with ``keep_parts``, the list of parts.

    Raises:
        ValueError: ``messages`` is neither, naming the argument; a message lacks a string
            ``role``, or its content is neither a string nor text parts, or is not valid Unicode,
            naming the conversation and message index.
    """
    conversations = messages if isinstance(messages, (list, tuple)) and messages and all(
        isinstance(c, (list, tuple)) for c in messages) else [messages]
    for conversation in conversations:
        if not isinstance(conversation, (list, tuple)) or not conversation or not all(
                isinstance(m, dict) for m in conversation):
            raise ValueError("messages must be a conversation (a non-empty list of message dicts such as "
                             "{'role': 'user', 'content': 'Hi'}) or a list of conversations, "
                             f"got {messages!r:.80}")
    parsed = []
    for c, conversation in enumerate(conversations):
        parsed.append([])
        for m, message in enumerate(conversation):
            where = f"messages: conversation {c}, message {m}"
            if not isinstance(message.get("role"), str):
                raise ValueError(f"{where} needs a string 'role', got {message!r:.80}")
            parsed[-1].append({**message, "content": _message_content(message.get("content"), where, keep_parts)})
    return parsed


CONTENT_FORMATS = ("auto", "string", "openai")
"""``chat_template_content_format`` values (vLLM's); "auto" is "string" here."""


def check_chat_args(add_generation_prompt, continue_final_message, content_format, chat_template_kwargs,
                    mm_processor_kwargs) -> dict:
    """``chat``'s switches checked; returns ``chat_template_kwargs`` as keyword arguments.

    Raises:
        ValueError: a switch that is not a bool, both True (vLLM's rule), an unknown content
            format, multi-modal processor kwargs, or bad ``chat_template_kwargs``
            (:func:`template_kwargs`).
    """
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        check_bool(name, value)
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message=True continues the last message, so it needs "
                         "add_generation_prompt=False (vLLM's rule)")
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, got {content_format!r}")
    if mm_processor_kwargs:
        raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r:.80} is not supported: no multi-modal models")
    return template_kwargs(chat_template_kwargs)


def render_chat(tokenizer, conversation: list[dict], chat_template, add_generation_prompt: bool,
                continue_final_message: bool, tools, extra: dict) -> str:
    """One conversation through the chat template (transformers' ``apply_chat_template``) as text.

    Raises:
        ValueError: the tokenizer has no chat template and none is given (transformers' error), or
            the template does not parse or fails to render (jinja2's message, with the template's
            source named).
    """
    kwargs = dict(extra)
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools is not None:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except TemplateError as error:
        source = "chat_template" if chat_template is not None else "the tokenizer's chat template"
        raise ValueError(f"{source} failed: {type(error).__name__}: {error}") from error


CHAT_ARGUMENTS = ("conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
                  "tools")
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

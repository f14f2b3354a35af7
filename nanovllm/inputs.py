"""vLLM's prompt types (``vllm.inputs``), so that ``from vllm.inputs import TokensPrompt`` ports by
changing the package name. They are plain dicts at run time; ``LLM.generate`` checks them
(``nanovllm.engine.prompts``)."""
from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt as token ids (``prompt_token_ids``, required); ``prompt``, when given, is reported
    as the output's prompt text, the ids being what runs (vLLM's rule)."""

    prompt_token_ids: list[int]
    prompt: str


PromptType = str | list[int] | TextPrompt | TokensPrompt
"""Any one prompt ``LLM.generate`` takes."""

"""The engine's tokenizer, and what it takes from the model's generation config: the
end-of-sequence ids it stops on and the default sampling fields."""
from transformers import AutoTokenizer, GenerationConfig

from nanovllm.config import Config


def eos_token_ids(model: str, tokenizer) -> list[int]:
    """End-of-sequence ids from ``generation_config.json`` (int or list) and the tokenizer."""
    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""generation_config.json keys -> SamplingParams fields (vLLM's ``get_diff_sampling_param``)."""


def default_sampling_fields(model: str) -> dict:
    """The SamplingParams fields that ``model``'s ``generation_config.json`` sets to other values
    than transformers' defaults (``GenerationConfig.to_diff_dict``); {} without the file."""
    try:
        config = GenerationConfig.from_pretrained(model).to_diff_dict()
    except (OSError, ValueError):
        return {}
    return {name: config[key] for key, name in _SAMPLING_FIELDS.items() if config.get(key) is not None}


def load_tokenizer(config: Config):
    """The tokenizer of ``config.tokenizer`` (default: the model directory).

    Raises:
        ValueError: the directory has no tokenizer transformers can load, naming it.
    """
    path = config.tokenizer or config.model
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {err}") from err

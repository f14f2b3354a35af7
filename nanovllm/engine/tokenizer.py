"""The engine's tokenizer, and what it takes from the model's generation config: the
end-of-sequence ids it stops on and the default sampling fields."""
from transformers import AutoTokenizer, GenerationConfig

from nanovllm.config import Config


def eos_token_ids(model: str, tokenizer, hf_config=None) -> list[int]:
    """End-of-sequence ids (int or list) from ``generation_config.json`` or, when the checkpoint
    has none, from ``hf_config`` (as transformers derives a generation config from the model's),
    and the tokenizer's."""
    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
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

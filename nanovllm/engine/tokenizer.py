"""The engine's tokenizer and the end-of-sequence ids it stops on."""
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

"""Where a model comes from: a local directory, or a Hugging Face Hub id (``"org/name"``) whose
weights, config and tokenizer files are fetched with ``huggingface_hub.snapshot_download`` (as
vLLM's ``LLM("org/name", revision=..., download_dir=...)``)."""
import logging
import os

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (GatedRepoError, HFValidationError, HfHubHTTPError,
                                    LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)
from huggingface_hub.utils import validate_repo_id

logger = logging.getLogger(__name__)

# What the engine reads: safetensors weights (and their index), config, generation config and
# tokenizer files (fast and slow tokenizers, chat templates); never other weight formats.
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                  "*.tiktoken", "chat_template.*"]


def is_hub_id(model: str) -> bool:
    """Whether ``model`` is spelled as a Hub repository id (``name`` or ``org/name``)."""
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def resolve_model(model, revision: str | None = None, download_dir: str | None = None, what: str = "model") -> str:
    """The local directory of ``model`` (``what``: "model" or "tokenizer", as errors name it):
    itself when it is a directory (or, for the model, not spelled as a Hub id: the engine then
    reports the missing directory), else a snapshot downloaded from the Hugging Face Hub (or
    found in its cache) at ``revision`` into ``download_dir`` (the Hub's cache when None),
    restricted to :data:`ALLOW_PATTERNS`.

    Raises:
        ValueError: ``model`` is not a string or path; it is a file; a tokenizer path that is
            neither a directory nor spelled as a Hub id; the Hub has no such repository or revision.
        RuntimeError: the download failed (offline, no network, access denied), naming the id.
    """
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"{what} must be a directory or a Hugging Face Hub id, got {model!r}")
    model = os.fspath(model)
    if os.path.isfile(model):
        raise ValueError(f"{what} {model!r} is a file; give the {what}'s directory (with config.json"
                         f"{' and safetensors weights' if what == 'model' else ' or tokenizer files'})")
    if what != "model" and not os.path.isdir(model) and not is_hub_id(model):
        raise ValueError(f"{what} directory {model!r} does not exist (and it is not a Hugging Face Hub id)")
    if os.path.isdir(model) or not is_hub_id(model):
        if revision is not None or download_dir is not None:
            logger.warning("model %r is a local path: revision and download_dir are not used", model)
        return model
    where = f"{model!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        path = snapshot_download(model, revision=revision, cache_dir=download_dir, allow_patterns=ALLOW_PATTERNS)
    except GatedRepoError as err:
        raise RuntimeError(f"{what} {model!r} is not a local directory, and the Hugging Face Hub model "
                           f"{where} is gated: log in with a token that has access ({err})") from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise ValueError(f"{what} {model!r} is not a local directory, and the Hugging Face Hub has no "
                         f"model {where}: {type(err).__name__}") from err
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise RuntimeError(f"{what} {model!r} is not a local directory, and downloading {where} from the "
                           f"Hugging Face Hub failed (offline, no network or no access, and not in the "
                           f"cache {download_dir or 'of huggingface_hub'}): {err}") from err
    logger.info("model %s: %s", where, path)
    return path

"""GGUF -> Hugging Face directory conversion (transformers' GGUF loader), used by
:mod:`nanovllm.fetch`. The loader needs the ``gguf`` and ``accelerate`` packages (the ``fetch``
extra: ``pip install "nanovllm[fetch]"``), imported only when a conversion runs."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# What transformers' GGUF loader imports, as in the fetch extra of pyproject.toml.
CONVERSION_REQUIREMENTS = {"gguf": "gguf>=0.10", "accelerate": "accelerate"}


def require_conversion_packages() -> None:
    """Check that the packages transformers' GGUF loader needs (``gguf``, ``accelerate``) import.

    Raises:
        RuntimeError: one of them cannot be imported; the message names every missing package
            and the pip commands that install them.
    """
    missing = {}
    for module, requirement in CONVERSION_REQUIREMENTS.items():
        try:
            importlib.import_module(module)
        except ImportError as e:
            missing[requirement] = e
    if missing:
        names = ", ".join(f"'{r}' ({e})" for r, e in missing.items())
        raise RuntimeError(
            f"converting a GGUF model needs packages that cannot be imported: {names}; install them "
            f"with: pip install {' '.join(repr(r) for r in missing)} (or nanovllm's fetch extra: "
            "pip install -e \".[fetch]\" in a checkout, pip install \"nanovllm[fetch]\" otherwise)"
        )


def convert_gguf(gguf_path: Path, out_dir: Path, eos_token_id: int, eos_token: str) -> None:
    """Dequantize the GGUF ``gguf_path`` to a bfloat16 HF directory ``out_dir`` (an existing, empty
    directory): ``config.json``, ``model.safetensors``, tokenizer files and
    ``generation_config.json``, every file mode 0644, with ``eos_token_id`` as the end token of
    both configs and no ``quantization_config``.

    Raises:
        RuntimeError: ``gguf`` or ``accelerate`` is missing (:func:`require_conversion_packages`),
            the tokenizer does not map ``eos_token`` to ``eos_token_id``, or the GGUF carries no
            chat template.
    """
    require_conversion_packages()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    src_dir, fname = str(gguf_path.parent), gguf_path.name
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=fname,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    logger.info("loaded and dequantized %s in %.1f s", fname, time.perf_counter() - t0)

    eos = eos_token_id
    if tokenizer.convert_tokens_to_ids(eos_token) != eos:
        raise RuntimeError(
            f"tokenizer maps {eos_token!r} to {tokenizer.convert_tokens_to_ids(eos_token)}, "
            f"expected {eos}"
        )
    if tokenizer.eos_token != eos_token:
        tokenizer.eos_token = eos_token
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"{fname} carries no chat template")

    # The engine reads eos from config/generation_config; make both agree on <|im_end|>.
    # The GGUF conversion carries quantization metadata we do not want in the saved config.
    if hasattr(model.config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
    with contextlib.suppress(AttributeError):
        model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        model.is_quantized = False
    model.config.eos_token_id = eos
    gen = model.generation_config if model.generation_config is not None else GenerationConfig()
    gen.eos_token_id = eos
    if gen.bos_token_id is None and tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    model.generation_config = gen

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # Belt and braces: rewrite generation_config.json so eos is exactly eos_token_id.
    gpath = out_dir / "generation_config.json"
    gcfg = json.loads(gpath.read_text()) if gpath.is_file() else {}
    gcfg["eos_token_id"] = eos
    gpath.write_text(json.dumps(gcfg, indent=2, sort_keys=True) + "\n")
    # And config.json without leftover quantization_config.
    cpath = out_dir / "config.json"
    cfg = json.loads(cpath.read_text())
    if cfg.pop("quantization_config", None) is not None or cfg.get("eos_token_id") != eos:
        cfg["eos_token_id"] = eos
        cpath.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in out_dir.iterdir():  # safetensors writes 0600; a shared cache wants 0644
        if f.is_file():
            f.chmod(0o644)
    logger.info("converted %s in %.1f s", fname, time.perf_counter() - t0)

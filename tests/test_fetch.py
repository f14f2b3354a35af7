"""nanovllm.fetch without network: hashing, reuse, atomic writes, errors."""

import hashlib
from pathlib import Path

import pytest

from nanovllm import fetch
from nanovllm.fetch import MODELS, default_dest, fetch_model, is_complete_model_dir, verify_sha256

SPEC = MODELS["smollm2"]


def _no_download(*args, **kwargs):
    raise AssertionError("fetch tried to download")


def _fake_complete(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name in fetch._REQUIRED_FILES:
        (path / name).write_text("{}")


def test_verify_sha256(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"nanovllm")
    digest = hashlib.sha256(b"nanovllm").hexdigest()
    assert verify_sha256(f, digest) == digest
    assert verify_sha256(f, digest.upper()) == digest
    wrong = "0" * 64
    with pytest.raises(RuntimeError) as e:
        verify_sha256(f, wrong)
    assert wrong in str(e.value) and digest in str(e.value)


def test_bad_gguf_raises_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "_download_gguf", _no_download)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    dest = tmp_path / "cache" / "model"
    with pytest.raises(RuntimeError) as e:
        fetch_model(dest=dest, gguf=bad)
    assert SPEC.sha256 in str(e.value)
    assert hashlib.sha256(b"not a gguf").hexdigest() in str(e.value)
    assert not dest.exists()
    assert not [p for p in dest.parent.iterdir() if ".tmp-" in p.name]


def test_reuses_complete_dir_without_download(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "_download_gguf", _no_download)
    monkeypatch.setattr(fetch, "_convert", _no_download)
    dest = tmp_path / "model"
    _fake_complete(dest)
    assert is_complete_model_dir(dest)
    assert fetch_model(dest=dest) == str(dest.absolute())


def test_default_dest_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    assert default_dest() == tmp_path / SPEC.cache_name
    monkeypatch.delenv("NANOVLLM_CACHE")
    assert default_dest() == Path.home() / ".cache" / "nanovllm" / SPEC.cache_name


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown model"):
        fetch_model("no-such-model")
    with pytest.raises(ValueError, match="not a file"):
        fetch_model(dest="/nonexistent/x", gguf="/nonexistent/model.gguf")


def test_incomplete_dir_is_replaced_atomically(tmp_path, monkeypatch):
    """An incomplete dest is replaced; a failing conversion leaves the old dest untouched."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    monkeypatch.setattr(fetch, "verify_sha256", lambda path, expected: expected)
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "config.json").write_text("{}")  # a half directory from some older tool

    def failing_convert(gguf_path, out_dir, spec):
        (out_dir / "config.json").write_text('{"partial": true}')
        raise RuntimeError("interrupted")

    monkeypatch.setattr(fetch, "_convert", failing_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        fetch_model(dest=dest, gguf=gguf)
    assert (dest / "config.json").read_text() == "{}"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    monkeypatch.setattr(fetch, "_convert", lambda gguf_path, out_dir, spec: _fake_complete(out_dir))
    assert fetch_model(dest=dest, gguf=gguf) == str(dest.absolute())
    assert is_complete_model_dir(dest)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_cli_reports_errors(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    assert fetch.main(["smollm2", str(tmp_path / "out"), "--gguf", str(bad), "-q"]) == 1
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and SPEC.sha256 in err

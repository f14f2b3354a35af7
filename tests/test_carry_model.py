"""benchmarks/carry_model.py without network or GPU: a small fake GGUF is split into parts, the
printed plan's device commands are run here (the device directory under tmp_path) and must join
the parts back into the same file, check each part and the whole file's sha256, survive a retried
call, refuse a skipped one, and end in the conversion of the joined file."""
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest

from nanovllm import fetch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def carry(tmp_path, monkeypatch):
    """The script as a module, its repository root, device directory and part size moved under
    tmp_path, and a 5-part fake model ``"fake"`` (parts of 1,000 bytes, the last one shorter)."""
    spec_ = importlib.util.spec_from_file_location("carry_model", ROOT / "benchmarks" / "carry_model.py")
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    repo = tmp_path / "repo"
    (repo / module.WHEEL_DIR).mkdir(parents=True)
    (repo / module.WHEEL_DIR / f"gguf-{importlib.metadata.version('gguf')}-py3-none-any.whl").write_bytes(b"w" * 10)
    monkeypatch.setattr(module, "ROOT", repo)
    monkeypatch.setattr(module, "DEVICE_DIR", tmp_path / "device")
    monkeypatch.setattr(module, "PART_BYTES", 1000)
    monkeypatch.setattr(module, "_tree_bytes", lambda: 900_000)
    data = os.urandom(4321)
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(data)
    monkeypatch.setitem(fetch.MODELS, "fake", fetch.ModelSpec(
        parts=(), gguf_name="fake.gguf", sha256=hashlib.sha256(data).hexdigest(), cache_name="fake",
        eos_token_id=2, eos_token="<|im_end|>"))
    monkeypatch.setattr(module, "MODELS", fetch.MODELS)
    monkeypatch.chdir(repo)  # device commands run in the repository root
    module.split("fake", str(gguf))
    return module, data


def _device_argvs(command: str) -> list[list[str]]:
    """The carry_model invocations of one device command, as argv lists."""
    return [shlex.split(args) for args in re.findall(r"python3 -m benchmarks\.carry_model (.*?)(?: &&|$)", command)]


def test_plan_joins_parts_back_and_converts(carry, monkeypatch):
    module, data = carry
    calls = module.plan("fake")
    assert len(calls) == 5
    assert all(len(c["command"]) < module.MAX_COMMAND for c in calls)
    assert [c["carry"] for c in calls[:-1]] == [[f".carry/fake/part{i:02d}"] for i in range(1, 5)]
    assert calls[-1]["carry"] == [".carry/fake/part05", module.WHEEL_DIR]
    assert calls[-1]["command"].startswith(module.INSTALL_WHEELS)
    converted = []
    monkeypatch.setattr(module, "fetch_model", lambda name, gguf: converted.append((name, Path(gguf).read_bytes())))
    for i, call in enumerate(calls):
        for argv in _device_argvs(call["command"]):
            module.main(argv)
        if i == 1:  # a retried call rewrites its part, it does not append it twice
            for argv in _device_argvs(call["command"]):
                module.main(argv)
    assert (module.DEVICE_DIR / "fake.gguf").read_bytes() == data
    assert converted == [("fake", data)]


def test_skipped_call_and_corrupt_part_are_refused(carry):
    module, _ = carry
    calls = module.plan("fake")
    module.main(_device_argvs(calls[0]["command"])[0])
    with pytest.raises(SystemExit, match="an earlier part is missing"):
        module.main(_device_argvs(calls[2]["command"])[0])
    part = module.ROOT / calls[1]["carry"][0]
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        module.main(_device_argvs(calls[1]["command"])[0])


def test_finish_refuses_a_wrong_file(carry, monkeypatch):
    module, data = carry
    monkeypatch.setattr(module, "fetch_model", lambda name, gguf: pytest.fail("converted a wrong file"))
    with pytest.raises(SystemExit, match="missing"):
        module.finish("fake")
    module.DEVICE_DIR.mkdir()
    (module.DEVICE_DIR / "fake.gguf").write_bytes(data[:-1])
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        module.finish("fake")


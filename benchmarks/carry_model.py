"""Bring a fetched model's GGUF to the GPU machine, which reaches no registry, and convert it there.

The device tool carries at most 64 MiB per call (working tree included) and keeps the machine's
disk only while it stays warm (30 s after a call). So the GGUF travels in parts of at most 56 MiB,
one per call, in consecutive calls: each call appends its part to a file under /root, and the last
one also checks the sha256 and converts the GGUF to a Hugging Face directory with nanovllm.fetch
(the ``gguf`` wheel carried in ``.whl``). Models: the keys of ``nanovllm.fetch.MODELS``
(``qwen2.5-coder-0.5b``, the long-context evaluation model: 491 MB, 9 parts; ``smollm2``: 2 parts).

Here (network), from the repository root::

    python -m benchmarks.carry_model split qwen2.5-coder-0.5b [--gguf PATH]
    python -m benchmarks.carry_model --print-plan qwen2.5-coder-0.5b [--json]

``split`` fetches the GGUF (``nanovllm.fetch.fetch_gguf``; default file
``~/.cache/nanovllm/<gguf name>``, reused when there), splits it into ``.carry/<model>/partNN``
(git-ignored), downloads the ``gguf`` wheel into ``.whl/`` (git-ignored) and prints the plan: one
device call per part, each with the paths to ``carry`` and the command (< 2,000 characters).

There (run by the plan's commands)::

    python3 -m benchmarks.carry_model append MODEL PART --offset N --sha256 HEX
    python3 -m benchmarks.carry_model finish MODEL

``append`` checks the part's sha256 and writes it at byte ``offset`` of ``/root/nanovllm-carry/<gguf
name>`` (a retried call rewrites its part; a missing earlier part is an error naming it); ``finish``
checks the whole file's sha256 and converts it into ``nanovllm.fetch.default_dest(MODEL)``
(``/root/.cache/nanovllm/<cache name>``), printing the path.
"""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from nanovllm.fetch import MODELS, default_dest, fetch_gguf, fetch_model, sha256_file, verify_sha256

ROOT = Path(__file__).resolve().parents[1]
CARRY_DIR = ".carry"
WHEEL_DIR = ".whl"
PART_BYTES = 56 << 20
"""Largest part: 56 MiB, leaving 8 MiB of a call's 64 MiB for the working tree and the wheels."""
CALL_BYTES = 64 << 20
MAX_COMMAND = 2000
DEVICE_DIR = Path("/root/nanovllm-carry")
DEVICE_PYTHON = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64")
INSTALL_WHEELS = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                  f"--target /tmp/site {WHEEL_DIR}/*.whl && export PYTHONPATH=/tmp/site || exit; ")


def _spec(name: str):
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name]


def _parts(name: str) -> list[Path]:
    return sorted((ROOT / CARRY_DIR / name).glob("part*"))


def split(name: str, gguf: str | None) -> None:
    """Fetch (or take) the GGUF, split it into parts of PART_BYTES, download the gguf wheel."""
    spec = _spec(name)
    path = Path(gguf) if gguf else default_dest(name).parent / spec.gguf_name
    if not path.is_file():
        fetch_gguf(name, path)
    verify_sha256(path, spec.sha256)
    out = ROOT / CARRY_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part*"):
        old.unlink()
    with open(path, "rb") as f:
        index = 1
        while chunk := f.read(PART_BYTES):
            (out / f"part{index:02d}").write_bytes(chunk)
            index += 1
    version = importlib.metadata.version("gguf")
    if not list((ROOT / WHEEL_DIR).glob(f"gguf-{version}-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *DEVICE_PYTHON,
                        "--quiet", "-d", str(ROOT / WHEEL_DIR), f"gguf=={version}"], check=True)


def _tree_bytes() -> int:
    """Bytes of the working tree that travels with every call: tracked and untracked-not-ignored
    files, and a ``shared/`` folder (it travels even where ignored)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    files = {ROOT / n.decode() for n in names if n} | set((ROOT / "shared").rglob("*"))
    return sum(f.stat().st_size for f in files if f.is_file())


def plan(name: str) -> list[dict]:
    """The device calls, in order: ``{"carry": [paths], "command": str, "carried_bytes": int}``."""
    parts = _parts(name)
    if not parts:
        raise SystemExit(f"no parts in {CARRY_DIR}/{name}: run `python -m benchmarks.carry_model split {name}` first")
    wheels = sorted((ROOT / WHEEL_DIR).glob("gguf-*.whl"))
    if not wheels:
        raise SystemExit(f"no gguf wheel in {WHEEL_DIR}/: run split first")
    sizes = [p.stat().st_size for p in parts]
    tree = _tree_bytes()
    wheel_bytes = sum(w.stat().st_size for w in (ROOT / WHEEL_DIR).glob("*.whl"))
    calls, offset = [], 0
    for i, (part, size) in enumerate(zip(parts, sizes)):
        rel = part.relative_to(ROOT).as_posix()
        command = (f"python3 -m benchmarks.carry_model append {name} {rel} --offset {offset} "
                   f"--sha256 {sha256_file(part)}")
        carry = [rel]
        carried = tree + size
        if i == len(parts) - 1:
            command = f"{INSTALL_WHEELS}{command} && python3 -m benchmarks.carry_model finish {name}"
            carry.append(WHEEL_DIR)
            carried += wheel_bytes
        if len(command) >= MAX_COMMAND or carried > CALL_BYTES:
            raise SystemExit(f"call {i + 1}: {len(command)} characters, {carried} bytes carried: over the limits "
                             f"({MAX_COMMAND} characters, {CALL_BYTES} bytes)")
        calls.append(dict(carry=carry, command=command, carried_bytes=carried))
        offset += size
    return calls


def print_plan(name: str, as_json: bool) -> None:
    calls = plan(name)
    if as_json:
        print(json.dumps(calls, indent=1))
        return
    spec = _spec(name)
    print(f"# {len(calls)} consecutive device calls (nvidia-h200), each within 30 s of the previous one (the machine "
          f"keeps its disk only while warm); timeout_s 600 for the last (it converts).")
    print(f"# Result: {default_dest(name).name} under /root/.cache/nanovllm (sha256 {spec.sha256} checked first).")
    print("# Append your own work to the last command with ' && ...' or send it as the next call within 30 s.")
    for i, call in enumerate(calls, 1):
        size = call["carried_bytes"] / 2**20
        print(f"\n# call {i} of {len(calls)}: carry={json.dumps(call['carry'])} ({size:.1f} MiB with the tree)")
        print(call["command"])


def append(name: str, part: str, offset: int, sha256: str) -> None:
    """Write ``part`` at byte ``offset`` of the device-side GGUF, after checking its sha256."""
    target = DEVICE_DIR / _spec(name).gguf_name
    verify_sha256(part, sha256)
    target.parent.mkdir(parents=True, exist_ok=True)
    have = target.stat().st_size if target.exists() else 0
    if have < offset:
        raise SystemExit(f"{target} has {have} bytes, the part goes at {offset}: an earlier part is missing "
                         "(the machine went cold between calls?); start the plan again from call 1")
    with open(target, "r+b" if target.exists() else "wb") as f:
        f.truncate(offset)  # a retried call rewrites its own part
        f.seek(offset)
        with open(part, "rb") as src:
            f.write(src.read())
    print(f"{target}: {offset + os.path.getsize(part)} bytes")


def finish(name: str) -> None:
    """Check the joined GGUF's sha256 and convert it; print the model directory."""
    spec = _spec(name)
    target = DEVICE_DIR / spec.gguf_name
    if not target.is_file():
        raise SystemExit(f"{target} is missing: run the plan's append calls first")
    verify_sha256(target, spec.sha256)
    print(fetch_model(name, gguf=target))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print-plan", metavar="MODEL", help="print the device calls for MODEL's parts")
    parser.add_argument("--json", action="store_true", help="with --print-plan: a JSON list of the calls")
    sub = parser.add_subparsers(dest="mode")
    p = sub.add_parser("split", help="here: fetch, split, download the gguf wheel, print the plan")
    p.add_argument("model")
    p.add_argument("--gguf", help="the GGUF file (default: fetched into ~/.cache/nanovllm)")
    p = sub.add_parser("append", help="there: write one part into the GGUF under /root")
    p.add_argument("model")
    p.add_argument("part")
    p.add_argument("--offset", type=int, required=True)
    p.add_argument("--sha256", required=True)
    p = sub.add_parser("finish", help="there: check the sha256 and convert")
    p.add_argument("model")
    args = parser.parse_args(argv)
    if args.print_plan:
        print_plan(args.print_plan, args.json)
    elif args.mode == "split":
        split(args.model, args.gguf)
        print_plan(args.model, args.json)
    elif args.mode == "append":
        append(args.model, args.part, args.offset, args.sha256)
    elif args.mode == "finish":
        finish(args.model)
    else:
        parser.error("give --print-plan MODEL or a mode (split, append, finish)")


if __name__ == "__main__":
    main()

"""Instruction census of the paged decode kernel's split pass, compiled for a GPU target without a
GPU (Triton's NVIDIA backend turns the kernel into PTX on any machine): per KV cache dtype, the
PTX's instructions by opcode (the part before the first '.'), and those of the tile loop, with the
warp instructions the loop issues per key. Prints one JSON document.

It compares what one program issues per cache dtype, not time: the loop over a tile of keys is
the same code per tile, so the work per key shows where a cache dtype spends instructions. The
variant compiled is bench.py's decode shape (Qwen3-0.6B: GQA group 2, head_dim 128, blocks of
256 tokens, a bfloat16 query), with the 16-byte divisibility the JIT finds for the engine's
pointers and strides, and each cache's tile of the engine (``split_block_n``) unless
``--block-n`` is given, and fp8 values read as words (``load_fp8_rows``). Instructions are the
PTX lines that start with an opcode, indented or not (the conversions Triton writes as inline
assembly are not indented), and the statements of inline-assembly blocks (``{ ...; ...; }``),
less their register declarations.
Usage, from the repository root: python -m benchmarks.ptx_census [--arch 90] [--block-n 64]
"""
import argparse
import collections
import importlib
import json
import re

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile

decode = importlib.import_module("nanovllm.ops.decode_attention")

CACHE_TYPES = {"bfloat16": "*bf16", "fp8_e4m3": "*fp8e4nv", "fp8_e5m2": "*fp8e5"}
_POINTERS = {"q_ptr": "*bf16", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "table_ptr": "*i32", "lens_ptr": "*i32",
             "starts_ptr": "*i32", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "scale_log2": "fp32"}
_ALIGNED = ("_ptr", "stride_qb", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
            "stride_vh", "stride_pb", "stride_ph", "tokens_per_split", "max_tokens")
_NUM_WARPS = 4
_INSTRUCTION = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*)[.\s]")
_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def _statements(line: str) -> list[str]:
    """The instructions of a PTX line: an inline-assembly block ``{ a; b; }`` split at ';' (its
    ``.reg`` declarations left out), else the line itself."""
    block = line.strip()
    if not (block.startswith("{") and block.endswith("}")):
        return [line]
    return [part for part in block[1:-1].split(";") if part.strip() and not part.strip().startswith(".reg")]


def opcodes(lines: list[str]) -> collections.Counter:
    """Opcode counts of the instructions among ``lines``."""
    return collections.Counter(m.group(1) for line in lines for statement in _statements(line)
                               if (m := _INSTRUCTION.match(statement)))


def tile_loop(lines: list[str]) -> list[str]:
    """The lines of the largest loop (a label and the last branch back to it): the tile loop."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := _BRANCH.search(line)) and labels.get(m.group(1), i) < i]
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return lines[start:end + 1]


def census(cache: str, arch: int, block_n: int | None = None) -> dict:
    """The split kernel over a ``cache`` (a key of :data:`CACHE_TYPES`) for ``sm_<arch>``:
    instructions by opcode, in the kernel and in its tile loop, and the loop's warp instructions
    per key."""
    names = decode.decode_split_kernel.arg_names
    scaled = cache != "bfloat16"
    tile = block_n or decode.split_block_n(scaled, 128)
    consts = dict(GROUP=2, G_CHUNKS=1, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=tile, BLOCK_SIZE=256,
                  DOT_PRECISION="tf32", WHILE_LOOP=False, FINAL=False, HAS_STARTS=False, SCALED=scaled,
                  FP8_WORDS=scaled)
    kv = CACHE_TYPES[cache]
    signature = {n: "constexpr" if n in consts else {"k_ptr": kv, "v_ptr": kv}.get(n, _POINTERS.get(n, "i32"))
                 for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and any(n.endswith(a) or n == a for a in _ALIGNED)}
    source = ASTSource(fn=decode.decode_split_kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ptx = triton_compile(source, target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": _NUM_WARPS, "num_stages": 2}).asm["ptx"]
    lines = ptx.splitlines()
    loop = opcodes(tile_loop(lines))
    return {"block_n": tile, "instructions": sum(opcodes(lines).values()), "loop_instructions": sum(loop.values()),
            "loop_warp_instructions_per_key": round(sum(loop.values()) * _NUM_WARPS / tile, 1),
            "loop_opcodes": dict(loop.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    parser.add_argument("--block-n", type=int, default=None, help="keys per tile (default: the engine's per cache)")
    args = parser.parse_args()
    print(json.dumps({"arch": args.arch, "kernel": "decode_attention split pass",
                      "caches": {cache: census(cache, args.arch, args.block_n) for cache in CACHE_TYPES}}, indent=1))


if __name__ == "__main__":
    main()

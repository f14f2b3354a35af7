"""Instruction census of the paged decode kernel's split pass, compiled for a GPU target without a
GPU (Triton's NVIDIA backend turns the kernel into PTX on any machine): per KV cache dtype, PTX
lines and the count of each opcode (the part before the first '.'); prints one JSON document.

It compares what one program issues per cache dtype, not time: the loop over a tile of keys is
the same code per tile, so instructions the fp8 cache adds per tile show up as the difference.
The variant compiled is bench.py's decode shape (Qwen3-0.6B: GQA group 2, head_dim 128, blocks of
256 tokens), with the 16-byte divisibility the JIT finds for the engine's pointers and strides.
Usage, from the repository root: python -m benchmarks.ptx_census [--arch 90]
"""
import argparse
import collections
import json
import re

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile

from nanovllm.ops.decode_attention import _decode_split_kernel

CACHE_TYPES = {"bfloat16": "*bf16", "fp8_e4m3": "*fp8e4nv", "fp8_e5m2": "*fp8e5"}
_POINTERS = {"q_ptr": "*bf16", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "table_ptr": "*i32", "lens_ptr": "*i32",
             "starts_ptr": "*i32", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "scale_log2": "fp32"}
_ALIGNED = ("_ptr", "stride_qb", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
            "stride_vh", "stride_pb", "stride_ph", "tokens_per_split", "max_tokens")


def census(cache: str, arch: int) -> dict:
    """PTX lines and opcode counts of the split kernel over a ``cache`` (a key of
    :data:`CACHE_TYPES`) for ``sm_<arch>``."""
    names = _decode_split_kernel.arg_names
    consts = dict(GROUP=2, G_CHUNKS=1, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, BLOCK_SIZE=256,
                  DOT_PRECISION="tf32", WHILE_LOOP=False, FINAL=False, HAS_STARTS=False,
                  SCALED=cache != "bfloat16")
    kv = CACHE_TYPES[cache]
    signature = {n: "constexpr" if n in consts else {"k_ptr": kv, "v_ptr": kv}.get(n, _POINTERS.get(n, "i32"))
                 for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and any(n.endswith(a) or n == a for a in _ALIGNED)}
    source = ASTSource(fn=_decode_split_kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ptx = triton_compile(source, target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
    ops = collections.Counter(m.group(1) for m in re.finditer(r"^\s+(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*)", ptx, re.M))
    return {"ptx_lines": len(ptx.splitlines()), "opcodes": dict(ops.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    args = parser.parse_args()
    print(json.dumps({"arch": args.arch, "kernel": "decode_attention split pass",
                      "caches": {cache: census(cache, args.arch) for cache in CACHE_TYPES}}, indent=1))


if __name__ == "__main__":
    main()

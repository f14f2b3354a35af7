"""The page-level decode kernel against the paged FULL kernel over the same KV; prints one JSON
document (issue 30: with every page selected the page-level read stays within 10% of FULL's).

One layer of ``--batch`` sequences of ``--context`` tokens (Llama-3.1-8B's 32 query / 8 KV heads of
128 by default, bf16) in a cache of ``--block-size``-token blocks, the blocks of each sequence in a
random order. Timed, each captured once in a CUDA graph and replayed (``bench_ops.graph_ms``):

- ``full``: :func:`~nanovllm.ops.decode_attention` with one block table per sequence, as FULL decode
  reads the GPU tier;
- ``pages_all``: the same call with a table per KV head over the cache viewed as pages of
  ``--page-size`` tokens, every page listed (what QUEST's decode reads when its budget covers the
  context);
- ``pages_fraction``: per KV head a random ``--fraction`` of the pages (sorted), as a choosing
  decode at that budget reads them.

Reported: milliseconds, KV TB/s, and ``pages_all_over_full`` (the time ratio; <= 1.10 targeted).

    python -m benchmarks.bench_page_decode
    python -m benchmarks.bench_page_decode --batch 2 --context 131072 --page-size 32
"""
import argparse
import json

import torch

from benchmarks.bench_ops import graph_ms
from nanovllm.ops import decode_attention


def page_tables(block_tables: torch.Tensor, block_size: int, page_size: int, heads_kv: int) -> torch.Tensor:
    """int32 ``[B, Hkv, M * block_size / page_size]``: every page of each row's blocks, in order,
    for every KV head (page ``p`` of block ``b`` is page ``b * pages_per_block + p`` of the cache
    viewed as pages)."""
    ppb = block_size // page_size
    pages = block_tables.long()[:, :, None] * ppb + torch.arange(ppb, device=block_tables.device)
    return pages.flatten(1)[:, None, :].expand(-1, heads_kv, -1).to(torch.int32).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.1)
    args = parser.parse_args()
    if args.context % args.block_size or args.block_size % args.page_size:
        raise ValueError(f"--context ({args.context}) must be a multiple of --block-size ({args.block_size}), "
                         f"and --block-size of --page-size ({args.page_size})")
    batch, heads_kv, dim, page = args.batch, args.heads_kv, args.head_dim, args.page_size
    blocks_per_seq = args.context // args.block_size
    shape = (batch * blocks_per_seq, args.block_size, heads_kv, dim)
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), args.context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, args.heads_q, dim, device="cuda", dtype=torch.bfloat16)
    k_pages, v_pages = (cache.view(-1, page, heads_kv, dim) for cache in (k_cache, v_cache))
    every = page_tables(tables, args.block_size, page, heads_kv)
    num_pages = every.shape[2]
    keep = max(1, round(args.fraction * num_pages))
    g = torch.Generator(device="cuda").manual_seed(0)
    chosen = torch.rand(batch, heads_kv, num_pages, device="cuda", generator=g).topk(keep, dim=2).indices.sort(2).values
    some = every.gather(2, chosen).contiguous()
    some_lens = torch.full((batch,), keep * page, dtype=torch.int32, device="cuda")
    scale = dim ** -0.5
    ms = {"full": graph_ms(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale)),
          "pages_all": graph_ms(lambda: decode_attention(q, k_pages, v_pages, every, lens, scale)),
          "pages_fraction": graph_ms(lambda: decode_attention(q, k_pages, v_pages, some, some_lens, scale))}
    token_bytes = 2 * heads_kv * dim * k_cache.element_size()
    read = {"full": batch * args.context * token_bytes, "pages_all": batch * args.context * token_bytes,
            "pages_fraction": batch * keep * page * token_bytes}
    print(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, **vars(args),
        "pages_per_head": num_pages, "pages_read_per_head": keep,
        "ms": {k: round(v, 4) for k, v in ms.items()},
        "kv_tb_per_s": {k: round(read[k] / ms[k] / 1e9, 3) for k in ms},
        "pages_all_over_full": round(ms["pages_all"] / ms["full"], 3),
        "pages_fraction_over_full": round(ms["pages_fraction"] / ms["full"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()

r"""Long sequences with the host tier of the KV cache and without (GPU-only); prints JSON.

    python bench_offload.py --input-len 130000 --block-size 4096                # one sequence, default budgets
    python bench_offload.py --input-len 32768 --num-seqs 8 --num-kvcache-blocks 32   # GPU tier: half the KV
    python bench_offload.py --shape llama-3-8b-1m --input-len 1000000 --decode-tokens 4 --modes gpu,tiered
    python bench_offload.py --shape glm-4-9b-1m --input-len 131072 --modes gpu,tiered   # GLM-4-9B-chat-1m
    python bench_offload.py --shape phi-3-mini-128k --input-len 120000 --modes gpu,tiered  # Phi-3-mini-128k
    python bench_offload.py --shape qwen2.5-0.5b --input-len 8192 --num-seqs 32 --block-size 256 \
        --num-kvcache-blocks 264 --modes gpu,tiered          # a small model, GPU tier at 1/4 of the KV
    python bench_offload.py --input-len 130000 --decode-tokens 16 --num-kvcache-blocks 2 \
        --modes tiered-full,tiered-noreuse,tiered --sparse-policy QUEST --sparse-page-size 16 \
        --sparse-token-budget 2048                         # QUEST with and without reuse vs FULL
    python bench_offload.py --input-len 130000 --num-kvcache-blocks 2 --modes tiered-full,tiered \
        --sparse-policy STREAMING --sparse-recent-tokens 4096   # sinks and a recent window only
    python bench_offload.py --input-len 130000 --num-kvcache-blocks 2 --kv-cache-dtype fp8  # fp8 KV, both tiers

Default model: a random-weight checkpoint of ``--shape`` (a key of ``tools.random_checkpoint.SHAPES``:
Llama-3.1-8B by default; Llama-3-8B with a 1,048,576-token context and Gradient AI's rope_theta;
GLM-4-9B-chat-1m; Phi-3-mini-128k; Qwen2.5-0.5B, 12 KiB of KV per token in bf16; Qwen3-0.6B),
created once under $NANOVLLM_CACHE.
Decode is timed from the second decode step on (the first places every sequence's next block and
compiles the decode kernels). Modes: ``gpu`` (host tier off), ``tiered``
(``enable_cpu_offload=True``, ``--sparse-policy`` with its ``--sparse-*`` options,
``--num-reuse-cache-blocks``), ``tiered-noreuse`` (the same without the reuse cache of a policy
that chooses decode pages) and ``tiered-full`` (the host tier with the FULL policy: the baseline of
``decode_over_tiered_full``, the decode speed of each other tiered mode over it). The sparse
options: ``--sparse-page-size`` (16, 32, 64), ``--sparse-token-budget`` (QUEST's tokens per KV head
and step), ``--sparse-sink-tokens``, ``--sparse-recent-tokens``, ``--sparse-dense-layers``,
``--sparse-group-score`` (QUEST: max or sum), ``--sparse-radius-weight`` (QUEST: in [0, 1]),
``--sparse-threshold`` (XATTN_BSA); each left
unset takes the engine's default. ``--sparse-topk-blocks`` is the engine's deprecated alias
(budget = it x ``--block-size``). Reported per mode: TTFT of the batch (every sequence has its first token),
prefill and decode tok/s (decode over ``decode_batch``, the sequences decoding together: fewer
than ``--num-seqs`` when the cache cannot hold them all and they run in turns), the tier split
during decode (``get_kv_cache_stats`` after the first decode step, which places every sequence's
next block), bytes moved each way, the host bytes read
per decode step, the longest decode step (the host's step call), the host memory pinned and the
steps that waited for pinning, the sparse statistics (with QUEST's reuse rate per layer), and on
CUDA decode as a fraction of its bound:

    time per step >= max((GPU-resident KV read + page metadata + weights) / HBM bandwidth,
                         host bytes read per decode step / pinned bandwidth)

with both bandwidths measured here (``decode_fraction_of_bound``). FULL reads every host-resident
block each step (the bound of host-resident KV); a policy that chooses decode pages (QUEST,
STREAMING) only the (page, KV head) pairs it reads from the host and does not find in the reuse
cache (host bytes counted as the host tier counts them, gathers included). On the GPU side FULL
reads every GPU-resident block; a choosing policy reads its decode density's share of them (the
density counts the reads of both tiers) and every used block's page metadata (QUEST's key bounds;
both tiers' live on the GPU). For such a policy over the host tier,
``decode_fraction_of_selected_bound`` also rates decode against every host (page, KV head) pair it
selects, reuse-cache hits included, moved over the link after the HBM time
(``selected_host_bytes_per_decode_step`` / pinned bandwidth + the GPU side above): the bound of a
step that reuses nothing and overlaps nothing. A mode the engine refuses (e.g. GPU-only at 1M
tokens) reports its error. ``--num-kvcache-blocks`` forces the GPU tier of every mode.
"""
import argparse
import gc
import json
import sys
import time
import traceback

import torch

from benchmarks.hardware import bandwidths
from nanovllm import LLM, SamplingParams
from nanovllm.sparse import (DEFAULT_GROUP_SCORE, DEFAULT_RADIUS_WEIGHT, DEFAULT_TOKEN_BUDGET, policy_class,
                             policy_names)
from nanovllm.utils.dtypes import KV_CACHE_DTYPES
from tools.random_checkpoint import SHAPES, cached_random_checkpoint

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


MODES = ("gpu", "tiered", "tiered-noreuse", "tiered-full")
SPARSE_OPTIONS = ("sparse_page_size", "sparse_token_budget", "sparse_sink_tokens", "sparse_recent_tokens",
                  "sparse_dense_layers", "sparse_group_score", "sparse_radius_weight", "sparse_topk_blocks",
                  "sparse_threshold")
"""Engine options of the ``--sparse-*`` arguments, passed when given (None: the engine's default)."""


def engine_kwargs(args, mode: str) -> dict:
    policy = "FULL" if mode == "tiered-full" else args.sparse_policy
    kwargs = dict(max_model_len=args.input_len + args.decode_tokens, kvcache_block_size=args.block_size,
                  max_num_seqs=args.num_seqs, enforce_eager=args.enforce_eager, device=args.device,
                  max_num_batched_tokens=args.max_num_batched_tokens, sparse_policy=policy,
                  kv_cache_dtype=args.kv_cache_dtype)
    if policy == args.sparse_policy:  # the FULL baseline takes none of the policy's options
        kwargs.update({name: getattr(args, name) for name in SPARSE_OPTIONS if getattr(args, name) is not None})
    if args.num_kvcache_blocks is not None:
        kwargs["num_kvcache_blocks"] = args.num_kvcache_blocks
    if mode != "gpu":
        kwargs.update(enable_cpu_offload=True, num_cpu_kvcache_blocks=args.num_cpu_kvcache_blocks)
        if args.num_ring_slots is not None:
            kwargs["num_ring_slots"] = args.num_ring_slots
    chooses = policy_class(policy).chooses_decode_pages
    if mode == "tiered" and chooses:
        kwargs["num_reuse_cache_blocks"] = args.num_reuse_cache_blocks
    elif mode == "tiered-noreuse":
        kwargs["num_reuse_cache_blocks"] = 0
    return kwargs


def random_prompts(args, vocab_size: int) -> list[list[int]]:
    """``args.num_seqs`` prompts of ``args.input_len`` random token ids (seed 0)."""
    g = torch.Generator().manual_seed(0)
    high = min(30000, vocab_size)
    return [torch.randint(1, high, (args.input_len,), generator=g).tolist() for _ in range(args.num_seqs)]


def _step_until(llm, done, step_times: list | None = None) -> list:
    """Step until ``done()``; the sequences finished. ``step_times``: each step's wall time (s) is
    appended (the host's view: with async scheduling a step's call returns once the next is launched)."""
    finished = []
    while not done():
        t = time.perf_counter()
        finished += llm.step()[0]
        if step_times is not None:
            step_times.append(time.perf_counter() - t)
    sync()
    return finished


def step_until_decoding(llm, report_every_s: float = 60.0) -> list:
    """Step until every added request is prefilled and has its first token; the sequences finished.
    Every ``report_every_s`` seconds the prompt tokens computed so far go to stderr (a long prefill
    that a time limit ends still says how far it got)."""
    start = last = time.perf_counter()

    def done() -> bool:
        nonlocal last
        now = time.perf_counter()
        if now - last >= report_every_s:
            computed = sum(s.num_computed_tokens for s in (*llm.scheduler.waiting, *llm.scheduler.running))
            print(f"prefill: {computed} tokens computed after {now - start:.0f} s", file=sys.stderr, flush=True)
            last = now
        return not llm.scheduler.waiting and all(s.num_completion_tokens for s in llm.scheduler.running)
    return _step_until(llm, done)


def _hbm_seconds(llm, stats: dict, bw: dict) -> float:
    """A decode step's HBM time for this tier split: the GPU-resident KV it reads, the page
    metadata and the weights (module doc)."""
    cache = llm.model_runner.cache
    weights = sum(p.numel() * p.element_size() for p in llm.model_runner.model.parameters())
    kv = stats["gpu_blocks_used"] * cache.geometry.block_bytes
    if cache.policy.chooses_decode_pages:
        density = llm.get_sparse_stats()["decode"]["density"]
        kv = kv * (1.0 if density is None else density)
        kv += (stats["gpu_blocks_used"] + stats["host_blocks_used"]) * cache.metadata_bytes_per_block()
    return (kv + weights) / (bw["hbm_gb_per_s"] * 1e9)


def _selected_host_bytes(llm) -> int:
    """Bytes of the host (page, KV head) reads a choosing policy's decode steps selected so far,
    reuse-cache hits included (0 without a host tier or such a policy; syncs with the device)."""
    cache = llm.model_runner.cache
    if cache.host is None or not cache.policy.chooses_decode_pages:
        return 0
    g = cache.geometry
    entry = g.layer_block_bytes * cache.policy.page_size // (g.block_size * g.num_kv_heads)
    return llm.get_sparse_stats()["decode"]["read_host_pages"] * entry


def _host_bytes_read(llm) -> int:
    """Bytes read from the host tier to the GPU so far, ring copies and page gathers (0 without a
    host tier; syncs with the device)."""
    host = llm.model_runner.cache.host
    return host.loaded_bytes() if host is not None else 0


def _pin_waits(llm) -> dict:
    """The steps that waited for host memory to be pinned, and how long in all (host tier only)."""
    host = llm.model_runner.cache.host
    if host is None:
        return {}
    return {"pin_waits": host.memory.num_waits, "pin_wait_s": round(host.memory.wait_s, 3)}


def _sparse_stats(llm) -> dict:
    """Both phases' statistics without the per-layer rows (decode: ``read_tokens`` /
    ``context_tokens`` per KV head, ``loaded_host_bytes`` / ``available_host_bytes``,
    ``reused_host_pages`` / ``read_host_pages``), decode's density and reuse rate per layer, and
    the policy's options as the engine runs them."""
    stats = llm.get_sparse_stats()
    out = {phase: {k: v for k, v in stats[phase].items() if k != "per_layer"} for phase in ("prefill", "decode")}
    for key in ("density", "reuse_rate"):
        values = [row.get(key) for row in stats["decode"]["per_layer"]]
        if any(value is not None for value in values) and len(set(values)) > 1:
            out["decode"][f"{key}_per_layer"] = [None if v is None else round(v, 3) for v in values]
    cfg = llm.config
    out["options"] = {name: getattr(cfg, name) for name in policy_class(cfg.sparse_policy).options}
    return out


def run_mode(args, mode: str, bw: dict) -> dict:
    try:
        llm = LLM(args.model, **engine_kwargs(args, mode))
    except (RuntimeError, ValueError) as err:
        return {"error": str(err)}
    try:
        return _measure(llm, args, bw)
    except (RuntimeError, ValueError) as err:  # e.g. a prompt the cache cannot hold
        traceback.print_exc(file=sys.stderr)
        return {"error": str(err)}
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def _measure(llm, args, bw: dict) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([list(range(1, 257))], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.reset_sparse_stats()
    before = llm.get_kv_cache_stats()
    host_bytes_before = _host_bytes_read(llm)
    for prompt in random_prompts(args, llm.config.hf_config.vocab_size):
        llm.add_request(prompt, params)
    sync()
    t0 = time.perf_counter()
    finished = step_until_decoding(llm)
    ttft = time.perf_counter() - t0
    # The first decode step places (and may spill) every sequence's next block and compiles the
    # decode kernels on a fresh Triton cache: decode is timed from the second step on.
    finished += llm.step()[0]
    sync()
    at_decode = llm.get_kv_cache_stats()
    # The sequences decoding together: fewer than --num-seqs when the cache cannot hold them all, in
    # which case they ran in turns (and the TTFT covers the earlier turns' whole decode).
    batch = len(llm.scheduler.running)
    host_bytes_at_decode, selected_at_decode = _host_bytes_read(llm), _selected_host_bytes(llm)
    t1 = time.perf_counter()
    step_times = []
    finished += _step_until(llm, llm.is_finished, step_times)
    decode_s = time.perf_counter() - t1
    after = llm.get_kv_cache_stats()
    block_bytes = llm.model_runner.cache.geometry.block_bytes
    steps = args.decode_tokens - 2
    host_bytes_per_step = (_host_bytes_read(llm) - host_bytes_at_decode) / steps
    selected_per_step = (_selected_host_bytes(llm) - selected_at_decode) / steps
    result = {"ttft_s": round(ttft, 3), "prefill_tok_per_s": round(args.num_seqs * args.input_len / ttft, 1),
              "decode_batch": batch, "decode_tok_per_s": round(batch * steps / decode_s, 2),
              "tpot_ms": round(decode_s / steps * 1e3, 3), "tiers_at_decode": at_decode,
              "bytes_h2d": _host_bytes_read(llm) - host_bytes_before,
              "bytes_d2h": (after["spilled_blocks"] - before["spilled_blocks"]) * block_bytes,
              "host_bytes_per_decode_step": round(host_bytes_per_step),
              "host_resident_bytes_at_decode": at_decode["host_blocks_used"] * block_bytes,
              "preemptions": after["preemptions"] - before["preemptions"],
              "max_decode_step_ms": round(max(step_times) * 1e3, 3) if step_times else None,
              "host_bytes_pinned": after["host_bytes_pinned"], **_pin_waits(llm),
              "kv_cache_dtype": after["kv_cache_dtype"], "gpu_tier_tokens": after["gpu_tokens"],
              "host_tier_tokens": after["host_tokens"],
              "tokens": [s.completion_token_ids for s in sorted(finished, key=lambda s: s.seq_id)]}
    if selected_per_step:
        result["selected_host_bytes_per_decode_step"] = round(selected_per_step)
    if torch.cuda.is_available():
        hbm_s, link = _hbm_seconds(llm, at_decode, bw), bw["pinned_h2d_gb_per_s"] * 1e9
        bound = batch / max(hbm_s, host_bytes_per_step / link)
        result.update(decode_bound_tok_per_s=round(bound, 2),
                      decode_fraction_of_bound=round(result["decode_tok_per_s"] / bound, 3))
        if selected_per_step:
            selected_bound = batch / (hbm_s + selected_per_step / link)
            result.update(decode_selected_bound_tok_per_s=round(selected_bound, 2),
                          decode_fraction_of_selected_bound=round(result["decode_tok_per_s"] / selected_bound, 3))
    policy = policy_class(llm.config.sparse_policy)
    if policy.chooses_decode_pages or not policy.dense_prefill:  # it reads less than everything somewhere
        result["sparse_stats"] = _sparse_stats(llm)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script (also read by ``benchmarks.profile_tiered_decode``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model dir (default: a random-weight checkpoint of --shape)")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--input-len", type=int, default=32768)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--num-seqs", type=int, default=1, help="sequences of --input-len, run together")
    parser.add_argument("--block-size", type=int, default=4096)
    parser.add_argument("--num-kvcache-blocks", type=int, default=None, help="force the GPU tier (both modes)")
    parser.add_argument("--num-cpu-kvcache-blocks", type=int, default=-1,
                        help="host tier blocks (-1: sized by the engine)")
    parser.add_argument("--num-ring-slots", type=int, default=None, help="host tier ring slots (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="prefill chunk")
    parser.add_argument("--sparse-policy", default="FULL", type=str.upper, choices=policy_names())
    parser.add_argument("--sparse-page-size", type=int, choices=(16, 32, 64),
                        help="QUEST / STREAMING: tokens per page, chosen per KV head (engine default 16)")
    parser.add_argument("--sparse-token-budget", type=int,
                        help=f"QUEST: tokens each KV head picks per decode step (engine default {DEFAULT_TOKEN_BUDGET})")
    parser.add_argument("--sparse-sink-tokens", type=int, help="QUEST / STREAMING: always-read first tokens (16)")
    parser.add_argument("--sparse-recent-tokens", type=int, help="QUEST / STREAMING: always-read last tokens (256)")
    parser.add_argument("--sparse-dense-layers", type=int, help="QUEST / STREAMING: first layers read whole (0)")
    parser.add_argument("--sparse-group-score", choices=("max", "sum"),
                        help=f"QUEST: how a KV head combines its query heads' page shares ({DEFAULT_GROUP_SCORE})")
    parser.add_argument("--sparse-radius-weight", type=float,
                        help=f"QUEST: weight of a page's key radius in its score, in [0, 1] ({DEFAULT_RADIUS_WEIGHT})")
    parser.add_argument("--sparse-topk-blocks", type=int,
                        help="deprecated: --sparse-token-budget = this x --block-size (the engine warns)")
    parser.add_argument("--sparse-threshold", type=float, help="XATTN_BSA: attention mass kept (0.97)")
    parser.add_argument("--num-reuse-cache-blocks", type=int, default=-1,
                        help="QUEST / STREAMING reuse cache in mode tiered (-1: the engine's default, 2 cells per "
                             "picked page and KV head)")
    parser.add_argument("--modes", default="gpu,tiered", help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="what both KV tiers store (LLM's kv_cache_dtype; the JSON's args say it)")
    parser.add_argument("--device", default="auto")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed, checked arguments (``argv``, by default the command line), ``args.model`` filled
    with the shape's random checkpoint when not given (argparse's error, exit 2, for a bad value)."""
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes must list some of {', '.join(MODES)}, got {args.modes!r}")
    for name in ("input_len", "decode_tokens", "num_seqs"):
        if getattr(args, name) < (3 if name == "decode_tokens" else 1):
            parser.error(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    if args.model is None:
        args.model = cached_random_checkpoint(args.shape)
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(args.model).max_position_embeddings
    if args.input_len + args.decode_tokens > limit:
        parser.error(f"--input-len + --decode-tokens = {args.input_len + args.decode_tokens} exceeds the model's "
                     f"max_position_embeddings={limit}")
    return args


def main():
    args = parse_args(build_parser())
    modes = args.modes.split(",")
    bw = bandwidths()
    results = {mode: run_mode(args, mode, bw) for mode in modes}
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **bw,
              "args": {k: v for k, v in vars(args).items() if k != "model"}}
    for mode, r in results.items():
        report[mode] = {k: v for k, v in r.items() if k != "tokens"}
    ok = {mode for mode, r in results.items() if "tokens" in r}
    if {"gpu", "tiered"} <= ok:
        gpu, tiered = results["gpu"], results["tiered"]
        report["tokens_identical"] = gpu["tokens"] == tiered["tokens"]
        report["tiered_over_gpu"] = {k: round(tiered[k] / gpu[k], 3) for k in ("prefill_tok_per_s", "decode_tok_per_s")}
    if {"tiered", "tiered-noreuse"} <= ok:  # the reuse cache changes traffic, not results (bf16 near-ties aside)
        same = results["tiered"]["tokens"] == results["tiered-noreuse"]["tokens"]
        report["tokens_identical_with_and_without_reuse"] = same
    if "tiered-full" in ok:
        full = results["tiered-full"]["decode_tok_per_s"]
        report["decode_over_tiered_full"] = {mode: round(results[mode]["decode_tok_per_s"] / full, 2)
                                             for mode in sorted(ok - {"gpu", "tiered-full"})}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

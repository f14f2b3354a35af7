"""Host work of decode over the host tier, per ring size: torch ops issued and wall time; prints JSON.

    python -m benchmarks.ring_host_ops --model DIR --ring-slots 2,default

Each setting builds an engine with the host tier on and a GPU tier of 2 blocks per sequence (so
every other block is read through the ring), runs ``--num-prompts`` prompts of ``--prompt-len``
token ids with ``--decode-tokens`` greedy tokens under ``torch.profiler`` (CPU activity), and
reports the ``aten::`` ops the generate call issued (on CUDA each is about one launch or copy: the
host work a step's ring costs), its wall time, the resolved ``ring_slots`` and ``loaded_blocks``,
and whether every setting produced the tokens of the first. A warm-up request runs first.
"""
import argparse
import json
import time


from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams


def run(model: str, slots: int | None, args) -> dict:
    kw = dict(enable_cpu_offload=True, num_kvcache_blocks=2 * args.num_prompts,
              max_model_len=args.prompt_len + args.decode_tokens + 256, max_num_seqs=args.num_prompts,
              num_cpu_kvcache_blocks=args.num_prompts * (-(-(args.prompt_len + args.decode_tokens) // 256) + 1),
              device=args.device, dtype=args.dtype)
    if slots is not None:
        kw["num_ring_slots"] = slots
    llm = LLM(model, **kw)
    try:
        prompts = [list(range(100 + i, 100 + i + args.prompt_len)) for i in range(args.num_prompts)]
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0][:512]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        before = llm.get_kv_cache_stats()["loaded_blocks"]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        stats = llm.get_kv_cache_stats()
        return {"ring_slots": stats["ring_slots"], "aten_ops": sum(e.count for e in prof.key_averages()
                                                                  if e.key.startswith("aten::")),
                "seconds": round(seconds, 3), "loaded_blocks": stats["loaded_blocks"] - before,
                "tokens": [o.outputs[0].token_ids for o in outputs]}
    finally:
        llm.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--ring-slots", default="2,default", help="comma-separated: integers >= 2 or 'default'")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--decode-tokens", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    settings = [None if s == "default" else int(s) for s in args.ring_slots.split(",")]
    rows = [run(args.model, slots, args) for slots in settings]
    same = all(row["tokens"] == rows[0]["tokens"] for row in rows)
    print(json.dumps({"model": args.model, "device": args.device, "num_prompts": args.num_prompts,
                      "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens, "same_tokens": same,
                      "rows": [{k: v for k, v in row.items() if k != "tokens"} for row in rows]}))


if __name__ == "__main__":
    main()

"""Where fp8 KV's error comes from, and which key offsets remove it, in HF transformers. Prints JSON.

    python -m benchmarks.key_offset_sources --model DIR [--tokens 2048] [--cases none,random,...]

HF transformers runs the model in float32 over ``--tokens`` tokens of text (docs/*.md by
default), its keys (after RoPE) and values fake-quantized per (token, KV head) to fp8 e4m3 as the
engine's store does (``nanovllm.ops.kv_quant.quantize_ref``), with the keys first shifted by an
offset per (layer, KV head, channel) (``nanovllm.kvcache.key_offset``), and is compared with
itself unquantized: teacher-forced top-1 agreement and the mean and 99th-percentile KL divergence
of the next-token distributions, one JSON line per case:

    none              keys and values quantized, no offset
    keys_only         keys quantized (no offset), values exact
    values_only       values quantized, keys exact
    random            the engine's offsets: the mean key over its seeded random calibration tokens
    code              the mean key over --calibration-text (the engine's Python sources by default)
    own_mean          the mean key over the evaluated text itself (a per-sequence offset)
    query_e4m3        the engine's offsets (``random``), and the query quantized too, per (token, head):
                      what an fp8 tensor-core product of q and the keys would add
    probs_e4m3        the engine's offsets, and the softmax's unnormalised probabilities
                      ``exp(s - max s)`` quantized to e4m3 at scale 1/448 (FlashAttention-3's fp8 P . V)
    query_probs_e4m3  both

Every case applies one quantization to every key and value the queries see (a decode's view,
each prompt token's own key included).
"""
import argparse
import functools
import glob
import importlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from nanovllm.kvcache.key_offset import CALIBRATION_TOKENS, calibration_token_ids
from nanovllm.ops.kv_quant import dequantize, quantize_ref

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def modeling_module(model: str):
    """The model's ``transformers.models.<type>.modeling_<type>`` module."""
    from transformers import AutoConfig

    kind = AutoConfig.from_pretrained(model).model_type
    return importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")


def fake_fp8(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[1, H, S, D]`` quantized per (token, head) to e4m3 and dequantized."""
    stored, scale, _ = quantize_ref(t[0].transpose(0, 1), torch.float8_e4m3fn)
    return dequantize(stored, scale, t.dtype).transpose(0, 1)[None]


@functools.cache
def _hf_model(model: str):
    """The model in HF transformers, float32, SDPA attention (loaded once per process)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()


def hf_logits(model: str, ids: list[int], attention=None) -> torch.Tensor:
    """HF transformers' float32 logits ``[len(ids), vocab]`` of one sequence; ``attention``
    ``(layer, query, key, value, sdpa, *args, **kwargs) -> (out, weights)`` replaces SDPA."""
    module = modeling_module(model)
    sdpa = module.ALL_ATTENTION_FUNCTIONS["sdpa"]
    hf = _hf_model(model)
    if attention is not None:
        hf.config._attn_implementation = "key_offset_bench"
        module.ALL_ATTENTION_FUNCTIONS["key_offset_bench"] = lambda *a, **k: attention(*a[:4], sdpa, *a[4:], **k)
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()
    finally:
        hf.config._attn_implementation = "sdpa"
        module.ALL_ATTENTION_FUNCTIONS.pop("key_offset_bench", None)


def hf_key_means(model: str, ids: list[int]) -> torch.Tensor:
    """HF transformers' keys after RoPE, float32, averaged over ``ids`` (one sequence from position
    0): ``[L, Hkv, D]``."""
    means = {}

    def record(layer, query, key, value, sdpa, *args, **kwargs):
        means[layer.layer_idx] = key[0].mean(1)
        return sdpa(layer, query, key, value, *args, **kwargs)

    hf_logits(model, ids, record)
    return torch.stack([means[i] for i in range(len(means))])


def quantized_logits(model: str, ids: list[int], offsets: torch.Tensor | None, keys: bool = True,
                     values: bool = True, query: bool = False, probs: bool = False) -> torch.Tensor:
    """HF logits with the keys (minus ``offsets`` ``[L, Hkv, D]`` when given) and values
    fake-quantized; ``query``: the query too; ``probs``: causal attention computed here, its
    unnormalised probabilities ``exp(s - max s)`` fake-quantized at scale 1/448 before the product
    with the values (their sum, the normaliser, unquantized)."""
    def attention(layer, q, key, value, sdpa, *args, **kwargs):
        if offsets is not None:
            key = key - offsets[layer.layer_idx][None, :, None]
        key, value = fake_fp8(key) if keys else key, fake_fp8(value) if values else value
        if query:
            q = fake_fp8(q)
        if not probs:
            return sdpa(layer, q, key, value, *args, **kwargs)
        group = q.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        s = (q @ key.transpose(-1, -2)) * layer.scaling
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        quantized = (p * FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() / FP8_E4M3_MAX
        return ((quantized @ value) / p.sum(-1, keepdim=True)).transpose(1, 2).contiguous(), None

    return hf_logits(model, ids, attention)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model directory")
    parser.add_argument("--text", nargs="+", default=sorted(glob.glob("docs/*.md")), help="text files, concatenated")
    parser.add_argument("--calibration-text", nargs="+", default=sorted(glob.glob("nanovllm/engine/*.py")),
                        help="text files for the 'code' offsets")
    parser.add_argument("--tokens", type=int, default=2048, help="positions of text (default 2048)")
    parser.add_argument("--cases", default=None, help="comma-separated cases to run (default: all)")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer("".join(Path(p).read_text() for p in args.text))["input_ids"][:args.tokens]
    code = tokenizer("".join(Path(p).read_text() for p in args.calibration_text))["input_ids"][:CALIBRATION_TOKENS]
    random_ids = calibration_token_ids(AutoConfig.from_pretrained(args.model).vocab_size, CALIBRATION_TOKENS)
    random_means = functools.cache(lambda: hf_key_means(args.model, random_ids.tolist()))
    cases = {
        "none": lambda: quantized_logits(args.model, ids, None),
        "keys_only": lambda: quantized_logits(args.model, ids, None, values=False),
        "values_only": lambda: quantized_logits(args.model, ids, None, keys=False),
        "random": lambda: quantized_logits(args.model, ids, random_means()),
        "code": lambda: quantized_logits(args.model, ids, hf_key_means(args.model, code)),
        "own_mean": lambda: quantized_logits(args.model, ids, hf_key_means(args.model, ids)),
        "query_e4m3": lambda: quantized_logits(args.model, ids, random_means(), query=True),
        "probs_e4m3": lambda: quantized_logits(args.model, ids, random_means(), probs=True),
        "query_probs_e4m3": lambda: quantized_logits(args.model, ids, random_means(), query=True, probs=True),
    }
    wanted = list(cases) if args.cases is None else args.cases.split(",")
    if unknown := sorted(set(wanted) - set(cases)):
        parser.error(f"unknown --cases {unknown}; known: {list(cases)}")
    reference = hf_logits(args.model, ids)
    top1, log_p = reference.argmax(-1), F.log_softmax(reference, -1)
    for name in wanted:
        logits = cases[name]()
        log_q = F.log_softmax(logits, -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        print(json.dumps({"case": name, "positions": len(ids),
                          "top1_agreement": round((logits.argmax(-1) == top1).float().mean().item(), 4),
                          "kl_mean": float(f"{kl.mean().item():.3g}"), "kl_p99": float(f"{kl.quantile(0.99).item():.3g}")}),
              flush=True)


if __name__ == "__main__":
    main()

"""How many compiled variants of each Triton kernel do the engine's launches need? (issue 14.5)

Triton compiles a kernel once per *specialisation key*: its constexpr values, each argument's type
and, for a parameter not in ``do_not_specialize``, whether an int is 1 or a multiple of 16 and
whether a tensor is 16-byte aligned, plus the launch options (num_warps, num_stages). On a fresh
cache each new key costs a compile (1-3 s for the XAttention kernels on the H200).

- The workloads make the ops calls that the XATTN_BSA prefill, every layer's prefill (RMSNorm, RoPE, KV store, SwiGLU) and the decode paths make for one length, on a device of
  choice.
- :data:`WORKLOADS` gives each the most keys a kernel may need over any set of lengths within one
  octave of :func:`nanovllm.ops._triton.row_tile` (up to 16K tokens at 128-token blocks): one per
  length-independent configuration (causal or not, the two load paths of the estimation).
- :func:`recorded_keys` (CPU, no GPU needed) replaces each kernel's launcher with one that computes
  the key with Triton's own argument binder (the code ``JITFunction.run`` uses, for an sm_90 CUDA
  target) and records it instead of compiling and launching, and sends CPU tensors down the ops'
  Triton paths, sized as for the GPU (not the interpreter), whose outputs are then left unwritten
  (only the launches matter).
  ``tests/gpu/test_compile_variants_gpu.py`` counts the real per-device kernel caches instead.
"""
import contextlib
import importlib
import sys
from collections import defaultdict

import torch

from _interpreter import require_triton
from nanovllm.ops import (apply_rotary, block_sparse_attention, decode_attend_merge, decode_attention,
                          gather_host_pages, merge_attention_outputs, rms_norm, silu_and_mul,
                          store_kvcache)
from nanovllm.ops.quest_scores import page_bounds
from nanovllm.ops.xattn_mask import xattn_block_mask

OP_MODULES = tuple(importlib.import_module(f"nanovllm.ops.{name}") for name in (
    "block_lists", "block_sparse_attention", "chunked_attention", "decode_attention", "decode_merge", "host_gather",
    "quest_scores", "rmsnorm",
    "rotary", "silu_and_mul", "store_kv", "xattn_estimate", "xattn_estimate_triton", "xattn_select",
    "xattn_mask"))

PROMPT_LENGTHS = (1500, 1517, 1536, 1561, 1600, 1633, 1664, 1701, 1750, 1791, 1856, 1907)
"""12 distinct prompt lengths in 1.5-2K tokens (issue 14's compile storm), multiples of 1, 8 and 16."""

LOAD_PATHS = 2
"""Pass A of the estimation loads q and k through TMA descriptors when both lengths are multiples of
the stride, else through pointers: two variants, whatever the lengths."""
SMOLLM2_HEADS = (9, 3, 64)
"""(q heads, kv heads, head_dim) of SmolLM2-135M, the model of the issue's measurement."""
H200_SMS = 132
SPARSE_BLOCK = 128
STRIDE = 8
THRESHOLD = 0.9


def _qkv(n: int, device, heads=SMOLLM2_HEADS, seed: int = 0):
    """q, k contiguous (as after rotary), v a view of the packed projection (as in the engine)."""
    heads_q, heads_kv, dim = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randn(n, heads_q + 2 * heads_kv, dim, device=device, generator=gen, dtype=torch.bfloat16)
    return (packed[:, :heads_q].contiguous(), packed[:, heads_q:heads_q + heads_kv].contiguous(),
            packed[:, heads_q + heads_kv:])


def xattn_prefill(n: int, device, heads=SMOLLM2_HEADS, chunk_size: int = 16384) -> None:
    """GPU-only XATTN_BSA prefill of one n-token prompt: estimation in chunks, selection, block-sparse
    attention (``XAttentionBSAPolicy._prefill_sequence``)."""
    q, k, v = _qkv(n, device, heads)
    mask = xattn_block_mask(q, k, THRESHOLD, STRIDE, SPARSE_BLOCK, None, chunk_size)
    block_sparse_attention(q, k, v, mask, SPARSE_BLOCK)


def decode_steps(n: int, device, heads=SMOLLM2_HEADS, batch: int = 4, kv_block: int = 256, page: int = 16) -> None:
    """Decode at context n: paged decode of a batch, one host-tier ring step folded into a running
    state (its last, partial block), QUEST's page bounds of every page, a gather of its picked host
    pages (per KV head, half skipped), decode over per-KV-head page tables and a prefix/chunk LSE
    merge of n rows."""
    heads_q, heads_kv, dim = heads
    blocks = -(-n // kv_block)
    cache = torch.zeros(blocks * batch, kv_block, heads_kv, dim, device=device, dtype=torch.bfloat16)
    tables = torch.arange(blocks * batch, device=device, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), n, device=device, dtype=torch.int32)
    decode_attention(torch.zeros(batch, heads_q, dim, device=device, dtype=torch.bfloat16), cache, cache, tables,
                     lens, dim**-0.5)
    tail = n - (blocks - 1) * kv_block
    out = torch.zeros(heads_q, dim, device=device)
    lse = torch.full((heads_q,), float("-inf"), device=device)
    decode_attend_merge(torch.zeros(heads_q, dim, device=device, dtype=torch.bfloat16), cache[0, :tail],
                        cache[0, :tail], out, lse, dim**-0.5)
    pages = cache.view(-1, page, heads_kv, dim)
    num_pages = -(-n // page)
    bounds = torch.zeros(num_pages * batch, heads_kv, dim, device=device, dtype=torch.bfloat16)
    page_ids = torch.arange(num_pages * batch, device=device).view(batch, num_pages)
    page_bounds(torch.zeros(batch, heads_q, dim, device=device, dtype=torch.bfloat16), bounds, bounds, page_ids)
    ids = torch.arange(num_pages, device=device)
    src = ids.masked_fill(ids % 2 == 1, -1)
    gather_host_pages(pages, pages, src, ids % heads_kv, pages, pages, ids.flip(0))
    head_tables = page_ids.to(torch.int32)[:, None].expand(batch, heads_kv, num_pages).contiguous()
    decode_attention(torch.zeros(batch, heads_q, dim, device=device, dtype=torch.bfloat16), pages, pages, head_tables,
                     lens, dim**-0.5)
    o = torch.zeros(1, n, heads_q, dim, device=device, dtype=torch.bfloat16)
    lse_rows = torch.zeros(1, heads_q, n, device=device)
    merge_attention_outputs(o, lse_rows, o, lse_rows)


def layer_steps(n: int, device, heads=SMOLLM2_HEADS, hidden: int = 576, intermediate: int = 1536,
                kv_block: int = 256) -> None:
    """The per-layer kernels of any prefill of n tokens: residual RMSNorm, RoPE on q/k views of the
    packed projection, the KV store into the paged cache, and the MLP's SwiGLU."""
    heads_q, heads_kv, dim = heads
    x = torch.zeros(n, hidden, device=device, dtype=torch.bfloat16)
    rms_norm(x, torch.ones(hidden, device=device, dtype=torch.bfloat16), 1e-5, x)
    packed = torch.zeros(n, heads_q + 2 * heads_kv, dim, device=device, dtype=torch.bfloat16)
    q, k, v = packed[:, :heads_q], packed[:, heads_q:heads_q + heads_kv], packed[:, heads_q + heads_kv:]
    positions = torch.arange(n, device=device)
    apply_rotary(positions, q, k, torch.zeros(2, 8192, dim // 2, device=device))
    cache = torch.zeros(-(-n // kv_block), kv_block, heads_kv, dim, device=device, dtype=torch.bfloat16)
    store_kvcache(k, v, cache, cache, positions)
    silu_and_mul(torch.zeros(n, 2 * intermediate, device=device, dtype=torch.bfloat16))


def kernels() -> dict:
    """``{"module.kernel": JITFunction}`` of every Triton kernel the ops modules define."""
    from triton.runtime.jit import JITFunction

    return {f"{m.__name__.rsplit('.', 1)[-1]}.{name}": fn for m in OP_MODULES for name, fn in vars(m).items()
            if isinstance(fn, JITFunction) and fn.__module__ == m.__name__ and name.endswith("_kernel")}


def _binder(kernel):
    """Triton's argument binder of ``kernel`` for an sm_90 target: (*args, **kwargs) -> (bound
    arguments, specialisation, options)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(kernel.signature, kernel.params, CUDABackend(GPUTarget("cuda", 90, 32)))


@contextlib.contextmanager
def recorded_keys(monkeypatch):
    """Yields ``{kernel name: set of specialisation keys}``, filled by the launches made inside the
    block (the ops' Triton paths taken for CPU tensors, nothing launched; the device is taken to
    have the H200's 132 SMs)."""
    require_triton()
    keys = defaultdict(set)
    for name, kernel in kernels().items():
        bind = _binder(kernel)

        def record(*args, grid, warmup, _name=name, _bind=bind, **kwargs):
            _, specialization, options = _bind(*args, **kwargs)
            keys[_name].add((tuple(map(str, specialization)), str(sorted(options.items()))))

        monkeypatch.setattr(kernel, "run", record)
    for module in OP_MODULES:
        if hasattr(module, "use_triton"):
            monkeypatch.setattr(module, "use_triton", lambda tensor: True)
        if hasattr(module, "interpreted"):
            monkeypatch.setattr(module, "interpreted", lambda tensor: False)
    monkeypatch.setattr(sys.modules["nanovllm.ops.decode_attention"], "_sm_count", lambda device: H200_SMS)
    yield keys


def varying(name: str, keys: set) -> dict:
    """``{parameter or "options": sorted distinct values}`` over the recorded keys of kernel
    ``name`` where they differ: what made Triton compile another variant."""
    params = [p.name for p in kernels()[name].params]
    columns = dict(zip(params + ["options"], zip(*(spec + (options,) for spec, options in keys))))
    return {param: sorted(set(values)) for param, values in columns.items() if len(set(values)) > 1}


WORKLOADS = {
    "xattn_prefill": (xattn_prefill, {
        "xattn_estimate_triton._xattn_partials_kernel": LOAD_PATHS,
        "xattn_estimate_triton._xattn_combine_kernel": 1,
        "xattn_select._select_kernel": 1, "block_lists._kept_block_lists_kernel": 1,
        "block_sparse_attention._bsa_kernel": 1}),
    "layer_steps": (layer_steps, {
        "rmsnorm._rms_norm_kernel": 1, "rotary._rotary_kernel": 1, "store_kv._store_kv_kernel": 1,
        "silu_and_mul._silu_and_mul_kernel": 1}),
    "decode_steps": (decode_steps, {
        # the split kernel: FINAL (one split writes the output, contexts under 512 here) or not, for
        # KV blocks and for pages
        "decode_attention.decode_split_kernel": 4, "decode_attention._decode_reduce_kernel": 1,
        "decode_merge._decode_attend_merge_kernel": 1, "chunked_attention._merge_kernel": 1,
        "host_gather._gather_host_pages_kernel": 1, "quest_scores._page_bounds_kernel": 1}),
}
"""``{name: (workload(n, device), {kernel: most variants over any lengths})}``; a workload launches
exactly the kernels listed."""

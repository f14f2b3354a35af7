"""Block-sparse attention on FlexAttention: a second backend of
:func:`nanovllm.ops.block_sparse_attention.block_sparse_attention`, with the same contract.

FlexAttention (``torch.nn.attention.flex_attention``, PyTorch 2.5+; Dong, Feng, Guessous, Liang,
He, "Flex Attention: A Programming Model for Generating Optimized Attention Kernels", 2024)
generates a fused FlashAttention-style Triton kernel under ``torch.compile`` that walks, per
(head, query block), the key blocks listed in a ``BlockMask``. Our bool block mask is turned into
that ``BlockMask`` directly (``BlockMask.from_kv_blocks``, no dense token mask): kept blocks whose
every key is visible to every query row go to the *full* lists (the kernel skips the mask there),
the others (crossing the causal diagonal or holding the end of the keys) to the *partial* lists,
where the kernel evaluates :func:`_mask_mod` per score.

Status: on the H200 it is 1.2-1.4x faster than our Triton kernel (docs/benchmarks.md) and passes
the op tests (tests/gpu/test_xattn_gpu.py), but ``block_sparse_attention`` does not dispatch to it
until it has also passed the engine tests on the GPU (the first try hit dynamo's recompile limit,
see :data:`RECOMPILE_LIMIT`); ``benchmarks/bench_xattn.py`` times both.

Compilation (CUDA): one ``torch.compile(dynamic=True, fullgraph=True)`` per process and per
``(block_size, causal, scale)``, made on first use; sequence lengths and block counts are
symbolic, so a new prefill length does not recompile. What does compile a new graph, once each: a
new dtype, head count or head_dim; a size that happened to equal another one when a graph was
compiled (dynamo's duck sizing ties them in that graph: ``Sq == Sk``, or a block count equal to
Hq, Hkv or head_dim) and then differs; ``Sq < 128`` versus ``Sq >= 128`` (flex's decoding-kernel
check); ``Sq == 1`` or ``Sk == 1`` (block counts are padded to >= 2 so they never are 1). All of
them share torch._dynamo's ``recompile_limit`` (default 8) for one code object; past it
``fullgraph=True`` raises ``FailOnRecompileLimitHit`` instead of falling back to flex's dense
eager path. Raise ``torch._dynamo.config.recompile_limit`` if a process needs more variants.
"""

import functools
import inspect

import torch
import torch.nn.functional as F

from .block_sparse_attention import _block_lists, _check_args, block_sparse_attention_ref

FLEX_TILE = 128
"""Flex's largest default kernel tile (BLOCK_M) on CUDA; a smaller block_size sets the tiles to it."""

RECOMPILE_LIMIT = 64
"""torch._dynamo's recompile limit while calling the compiled kernel: every (block_size, causal,
scale, kernel options) shares one code object, and with the graphs listed above a process can pass
dynamo's default of 8 (measured: a test process did, and fullgraph=True then raises)."""

HOPPER_OPTIONS = (("USE_TMA", True), ("BLOCK_M", 128), ("BLOCK_N", 128), ("num_warps", 8), ("num_stages", 2))
"""Flex kernel options on sm_90 for block_size >= 128 and head_dim <= 128: TMA loads and 128 x 128
tiles, measured 7-9% faster than flex's defaults on the H200 (bf16, head_dim 128, 32K tokens,
densities 0.3 and 0.5; docs/benchmarks.md)."""


@functools.cache
def _flex():
    """``torch.nn.attention.flex_attention``, imported on first use (importing nanovllm never
    needs it). Raises RuntimeError where it is missing (PyTorch < 2.5)."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError as error:
        raise RuntimeError("FlexAttention (torch.nn.attention.flex_attention, PyTorch 2.5+) is "
                           "unavailable") from error
    return flex_attention


def _full_layout(n_q: int, n_k: int, block_size: int, seq_q: int, seq_k: int, causal: bool,
                 device) -> torch.Tensor:
    """bool ``[n_q, n_k]``: key block kb lies inside the keys and, if causal, its last key is at or
    before the position (``Sk - Sq + row``) of query block qb's first row, so every key of the
    block is visible to every row. Query rows past Sq need not be excluded: flex neither stores
    them nor lets them touch the real rows."""
    key_end = (torch.arange(n_k, device=device) + 1) * block_size
    inside = (key_end <= seq_k)[None, :]
    if not causal:
        return inside.expand(n_q, n_k)
    first_pos = seq_k - seq_q + torch.arange(n_q, device=device) * block_size
    return inside & (key_end[None, :] - 1 <= first_pos[:, None])


def flex_block_lists(
    mask: torch.Tensor, block_size: int, seq_q: int, seq_k: int, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block lists of a FlexAttention ``BlockMask`` for our block mask.

    Args:
        mask: bool ``[Hq, nQ, nK]``, the kept key blocks per (head, query block).
        block_size: tokens per block; seq_q, seq_k: the lengths behind the blocks (queries
            bottom-right aligned: row i sits at key position ``seq_k - seq_q + i``).
        causal: whether keys after a row's position are hidden.

    Returns:
        ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)``, int32 ``[1, Hq, nQ]``
        and ``[1, Hq, nQ, nK]`` (contiguous): the partial then the full kept blocks, each listed
        first and ascending (see :func:`_full_layout`). Built on the device by sort, no host sync.
    """
    n_q, n_k = mask.shape[1], mask.shape[2]
    full = mask & _full_layout(n_q, n_k, block_size, seq_q, seq_k, causal, mask.device)
    lists = (*_block_lists(mask & ~full), *_block_lists(full))
    return tuple(t[None] for t in lists)


def _mask_mod(offset: torch.Tensor, causal: bool):
    """The kernel's ``mask_mod(b, h, q_idx, kv_idx) -> bool``: ``q_idx + offset >= kv_idx`` when
    causal (``offset`` a 0-d int tensor, Sk - Sq, so the lengths stay out of the compiled graph's
    constants), else None. Compiled flex evaluates it only in the partial blocks, which are kept
    blocks by construction, and masks keys past Sk itself."""
    if not causal:
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    return mask_mod


def _eager_mask_mod(kept: torch.Tensor, offset: torch.Tensor, block_size: int, causal: bool):
    """:func:`_mask_mod` and the block lookup ``kept[h, q_idx // block_size, kv_idx //
    block_size]``: flex's eager path (CPU) applies the mask_mod to every score and ignores the
    block lists, so the mask_mod must be the whole token mask there."""
    causal_mod = _mask_mod(offset, causal)

    def mask_mod(b, h, q_idx, kv_idx):
        visible = kept[h, q_idx // block_size, kv_idx // block_size]
        return visible & causal_mod(b, h, q_idx, kv_idx) if causal else visible

    return mask_mod


def _lse_request() -> dict:
    """flex_attention keyword asking for the log-sum-exp: ``return_aux=AuxRequest(lse=True)``
    where AuxRequest exists, else the older ``return_lse=True``."""
    flex = _flex()
    if hasattr(flex, "AuxRequest"):
        return {"return_aux": flex.AuxRequest(lse=True)}
    return {"return_lse": True}


def _from_kv_blocks_options() -> dict:
    """``compute_q_blocks=False`` (no transposed lists: they serve only the backward) where
    BlockMask.from_kv_blocks takes it."""
    parameters = inspect.signature(_flex().BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if "compute_q_blocks" in parameters else {}


def _kernel_options(q: torch.Tensor, block_size: int) -> tuple:
    """Flex ``kernel_options`` as sorted items (hashable): tiles of block_size below 128, else
    :data:`HOPPER_OPTIONS` on sm_90 for head_dim <= 128, else flex's defaults."""
    if block_size < FLEX_TILE:
        return (("BLOCK_M", block_size), ("BLOCK_N", block_size))
    if q.is_cuda and q.shape[-1] <= 128 and torch.cuda.get_device_capability(q.device)[0] == 9:
        return HOPPER_OPTIONS
    return ()


@functools.cache
def _attend_fn(block_size: int, causal: bool, scale: float, compiled: bool, options: tuple = ()):
    """``attend(q, k, v, kept, offset, *lists) -> (out [1, Hq, Sq, D], lse float32 [1, Hq, Sq])``
    with q ``[1, Hq, Sq, D]``, k, v ``[1, Hkv, Sk, D]``; ``options`` the kernel_options items
    (:func:`_kernel_options`); compiled once per process and key."""
    flex = _flex()
    lse_request, block_options = _lse_request(), _from_kv_blocks_options()
    kernel_options = dict(options) or None

    def attend(q, k, v, kept, offset, counts, indices, full_counts, full_indices):
        block_mask = flex.BlockMask.from_kv_blocks(
            counts, indices, full_counts, full_indices, BLOCK_SIZE=block_size,
            mask_mod=_mask_mod(offset, causal) if compiled else _eager_mask_mod(kept, offset, block_size, causal),
            seq_lengths=(q.shape[-2], k.shape[-2]),
            **block_options,
        )
        out, aux = flex.flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                                       kernel_options=kernel_options, **lse_request)
        return out, aux.lse if "return_aux" in lse_request else aux

    return torch.compile(attend, dynamic=True, fullgraph=True) if compiled else attend


def flex_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    block_size: int = 128,
    scale: float | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention backend of :func:`nanovllm.ops.block_sparse_attention.block_sparse_attention`:
    same arguments, results and errors.

    Query row i (position ``Sk - Sq + i``) of block ``i // block_size`` attends to key j iff
    ``mask[h, i // block_size, j // block_size]`` and, if causal, ``j <= Sk - Sq + i``.

    Args:
        q: ``[Sq, Hq, D]``; k, v: ``[Sk, Hkv, D]``; ``Hq % Hkv == 0`` (GQA through flex's
            ``enable_gqa``, no repeated kv heads), ``1 <= D <= 256``; float16/bfloat16/float32 of
            one dtype (float64 goes to the reference). Passed to flex as ``[1, H, S, D]`` transpose
            views (no copy; rows may be strided).
        mask: bool ``[Hq, ceil(Sq / block_size), ceil(Sk / block_size)]`` on q's device.
        block_size: tokens per block, a power of two in 16..1024 (CUDA below 128: flex's tiles are
            set to block_size).
        scale: softmax scale (default ``D ** -0.5``).
        causal: bottom-right aligned causal mask inside the kept blocks.

    Returns:
        ``(out [Sq, Hq, D] in q.dtype, lse float32 [Hq, Sq])``, lse the natural log of the sum of
        exp(scaled scores) over the attended keys (flex returns it in natural log). Rows that see
        no key: out 0, lse -inf (flex's fully-masked-row rule, the same).

    Raises:
        ValueError: as block_sparse_attention.
        RuntimeError: FlexAttention missing from this PyTorch.
        NotImplementedError: inputs that require grad on CPU (flex has no CPU backward; this is
            an inference op).

    CUDA: the compiled flex kernel (see the module docstring for compilation); per call a few
    small device ops build the block lists (no host sync). Elsewhere: flex's eager path, which
    materialises the ``[Hq, Sq, Sk]`` scores (correctness only). The output is contiguous: flex
    lays it out like q's transpose view, so the transpose back is free.
    """
    _check_args(q, k, v, mask, block_size)
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    seq_q, seq_k = q.shape[0], k.shape[0]
    if q.dtype == torch.float64 or seq_q == 0 or seq_k == 0:
        return block_sparse_attention_ref(q, k, v, mask, block_size, scale, causal)
    causal = bool(causal)
    # Pad nQ and nK to >= 2 (with unkept blocks): a size-1 dim would compile its own graph.
    kept = F.pad(mask, (0, int(mask.shape[2] < 2), 0, int(mask.shape[1] < 2))).contiguous()
    offset = torch.full((), seq_k - seq_q, dtype=torch.int32, device=q.device)
    lists = flex_block_lists(kept, block_size, seq_q, seq_k, causal)
    attend = _attend_fn(block_size, causal, scale, q.is_cuda, _kernel_options(q, block_size))
    heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        out, lse = attend(*heads_first, kept, offset, *lists)
    return out[0].transpose(0, 1).contiguous(), lse[0]

"""Fused greedy / temperature sampling: the exponential race (Gumbel-max) in one pass over the logits.

A sampled row with temperature T draws token ``argmax_v(logit_v / T - log(E_v))`` with
``E_v = -log(U_v)`` ~ Exp(1), U uniform: since ``log p_v = logit_v / T - logsumexp``, this is
``argmax_v(p_v / E_v)`` over ``p = softmax(logits / T)``, the exponential race that vLLM's sampler
runs (``probs.div_(q.exponential_()).argmax()``), i.e. the Gumbel-max trick (``-log E_v`` is
Gumbel(0, 1)): token v wins with probability ``p_v``. No softmax, no float32 copy of the logits and
no noise tensor are materialised; a greedy row (T below :data:`SAMPLING_EPS`) takes the exact argmax
of its logits (the first index on ties, like ``torch.argmax``).

Noise: Philox4x32-10 (``tl.rand4x``) keyed by the row's int64 seed, counter = position in the
vocabulary, so a row's draw depends only on its seed and logits, never on its batch.

Grid: one program per (row, chunk of ``4 * BLOCK`` tokens), then a one-program-per-row pass over
the chunks' (max, first argmax). Decode batches run from 1 row to hundreds: splitting the vocabulary
(151,936 tokens: 38 chunks of 4096) keeps 38 programs in flight for one row, while at 256 rows the
~10K programs are balanced over the SMs; one program per row would leave all but one SM idle at
batch 1, and a row-loop would add per-row serial latency. The second pass reads 38 pairs per row.
"""

import torch

from nanovllm.sampling_params import SAMPLING_EPS

from nanovllm.utils.ints import cdiv

from ._triton import next_pow2
from .backend import interpreted, tl, triton, use_triton

_BLOCK = 1024
"""Tokens per Philox draw block: one ``rand4x`` call yields 4 blocks, so a program covers 4096."""
_INTERPRET_BLOCK = 16
"""The block under Triton's interpreter (every element costs numpy work there)."""
SEED_HIGH = 2**63 - 1
"""Seeds are drawn uniformly from [0, SEED_HIGH)."""


def _check_args(logits, temperatures, seeds, uniforms) -> None:
    if logits.dim() != 2 or logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits must be [rows, vocab] float16/bfloat16/float32; got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits need a contiguous vocab dimension; got strides {logits.stride()}")
    rows = logits.size(0)
    if logits.size(1) == 0:
        raise ValueError("logits must have a vocab dimension >= 1; got 0")
    if temperatures is not None and (temperatures.shape != (rows,) or temperatures.dtype != torch.float32):
        raise ValueError(f"temperatures must be float32 [{rows}]; got {tuple(temperatures.shape)} {temperatures.dtype}")
    if seeds is not None and (seeds.shape != (rows,) or seeds.dtype != torch.int64):
        raise ValueError(f"seeds must be int64 [{rows}]; got {tuple(seeds.shape)} {seeds.dtype}")
    if temperatures is not None and seeds is None and uniforms is None:
        raise ValueError("sampled rows need seeds (or explicit uniforms); got neither")
    if uniforms is not None and (uniforms.shape != logits.shape or uniforms.dtype != torch.float32
                                 or uniforms.stride(1) != 1):
        raise ValueError(f"uniforms must be float32 {tuple(logits.shape)} with a contiguous last dimension; got "
                         f"{tuple(uniforms.shape)} {uniforms.dtype} strides {uniforms.stride()}")
    for name, t in (("temperatures", temperatures), ("seeds", seeds), ("uniforms", uniforms)):
        if t is not None and t.device != logits.device:
            raise ValueError(f"{name} must be on logits' device {logits.device}; got {t.device}")


def sample_race_ref(logits: torch.Tensor, temperatures: torch.Tensor | None, seeds: torch.Tensor | None,
                    uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`sample_race` (same arguments and result), in float32 torch ops.

    With ``uniforms`` it computes exactly the kernel's formula on them. Without, it draws each
    sampled row's uniforms from a torch CPU generator seeded with the row's seed (one host sync):
    the same distribution as the kernel's Philox noise, not the same numbers."""
    _check_args(logits, temperatures, seeds, uniforms)
    scores = logits.float()
    if temperatures is None:
        return scores.argmax(-1)
    sampled = temperatures >= SAMPLING_EPS
    if uniforms is None:
        uniforms = torch.zeros(logits.shape, dtype=torch.float32)
        for row, (is_sampled, seed) in enumerate(zip(sampled.tolist(), seeds.tolist())):
            if is_sampled:
                uniforms[row] = torch.rand(logits.size(1), generator=torch.Generator().manual_seed(seed))
        uniforms = uniforms.to(logits.device)
    raced = scores * (1 / temperatures).unsqueeze(1) - torch.log(-torch.log(uniforms))
    return torch.where(sampled.unsqueeze(1), raced, scores).argmax(-1)


@triton.jit
def _block_best(logits_row, u_ptr, u_off, start, j, vocab, inv_temperature, gumbel, best_val, best_idx,
                FIRST: tl.constexpr, SAMPLED: tl.constexpr, GIVEN_UNIFORMS: tl.constexpr):
    """The running (max score, first argmax) after the block of tokens ``start + j``; ``gumbel``
    its Philox noise ``-log(-log U)`` (unused with GIVEN_UNIFORMS or for a greedy row). A NaN
    score counts as +inf (torch.argmax takes NaN as the maximum), so the winner is a real token."""
    cols = start + j
    mask = cols < vocab
    score = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if SAMPLED:
        if GIVEN_UNIFORMS:
            u = tl.load(u_ptr + u_off + cols, mask=mask, other=0.5)
            gumbel = -tl.log(-tl.log(u))
        score = score * inv_temperature + gumbel
    score = tl.where(score != score, float("inf"), score)
    val, idx = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    if FIRST:
        best_val, best_idx = val, idx + start
    else:
        better = val > best_val
        best_val, best_idx = tl.where(better, val, best_val), tl.where(better, idx + start, best_idx)
    return best_val, best_idx


@triton.jit
def _chunk_best(logits_row, u_ptr, u_off, seed_ptr, row, base, vocab, inv_temperature, BLOCK: tl.constexpr,
                SAMPLED: tl.constexpr, GIVEN_UNIFORMS: tl.constexpr):
    """(max score, first argmax) of the 4 * BLOCK tokens from ``base``: one Philox4x32 call gives
    the noise of all four blocks (counter ``base / 4 + j`` for token ``base + k * BLOCK + j``)."""
    j = tl.arange(0, BLOCK)
    g0 = tl.zeros([BLOCK], tl.float32)
    g1, g2, g3 = g0, g0, g0
    if SAMPLED and not GIVEN_UNIFORMS:
        u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr + row), base // 4 + j)
        g0, g1, g2, g3 = -tl.log(-tl.log(u0)), -tl.log(-tl.log(u1)), -tl.log(-tl.log(u2)), -tl.log(-tl.log(u3))
    val, idx = _block_best(logits_row, u_ptr, u_off, base, j, vocab, inv_temperature, g0, 0.0, 0,
                           True, SAMPLED, GIVEN_UNIFORMS)
    val, idx = _block_best(logits_row, u_ptr, u_off, base + BLOCK, j, vocab, inv_temperature, g1, val, idx,
                           False, SAMPLED, GIVEN_UNIFORMS)
    val, idx = _block_best(logits_row, u_ptr, u_off, base + 2 * BLOCK, j, vocab, inv_temperature, g2, val, idx,
                           False, SAMPLED, GIVEN_UNIFORMS)
    val, idx = _block_best(logits_row, u_ptr, u_off, base + 3 * BLOCK, j, vocab, inv_temperature, g3, val, idx,
                           False, SAMPLED, GIVEN_UNIFORMS)
    return val, idx


@triton.jit(do_not_specialize=["stride_u"])
def _race_chunks_kernel(logits_ptr, temp_ptr, seed_ptr, u_ptr, val_ptr, idx_ptr, vocab, stride_row, stride_u,
                        num_chunks, greedy_below, HAS_TEMPERATURE: tl.constexpr, GIVEN_UNIFORMS: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's (max score, first argmax) into ``val`` / ``idx`` [rows, chunks].
    ``vocab`` and ``stride_row`` are fixed by the model and stay specialised: their alignment lets
    Triton load 16 bytes per thread (the PTX has scalar loads without it)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = chunk * 4 * BLOCK
    logits_row, u_off = logits_ptr + row * stride_row, row * stride_u
    if HAS_TEMPERATURE:
        temperature = tl.load(temp_ptr + row)
        if temperature >= greedy_below:
            val, idx = _chunk_best(logits_row, u_ptr, u_off, seed_ptr, row, base, vocab, 1.0 / temperature, BLOCK,
                                   True, GIVEN_UNIFORMS)
        else:
            val, idx = _chunk_best(logits_row, u_ptr, u_off, seed_ptr, row, base, vocab, 1.0, BLOCK,
                                   False, GIVEN_UNIFORMS)
    else:
        val, idx = _chunk_best(logits_row, u_ptr, u_off, seed_ptr, row, base, vocab, 1.0, BLOCK,
                               False, GIVEN_UNIFORMS)
    tl.store(val_ptr + row * num_chunks + chunk, val)
    tl.store(idx_ptr + row * num_chunks + chunk, idx)


@triton.jit
def _race_merge_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    """Per row: the first index holding the largest of its chunks' maxima."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    val = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=2**31 - 1)
    best = tl.max(val, 0)
    tl.store(out_ptr + row, tl.min(tl.where(mask & (val == best), idx, 2**31 - 1), 0).to(tl.int64))


def sample_race(logits: torch.Tensor, temperatures: torch.Tensor | None, seeds: torch.Tensor | None,
                uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row: greedy rows take the argmax, sampled rows the exponential race.

    Args:
        logits: ``[rows, vocab]`` float16/bfloat16/float32, any row stride, contiguous vocab
            dimension. Read once, never copied.
        temperatures: float32 ``[rows]``; rows below :data:`SAMPLING_EPS` (1e-5) are greedy.
            None: every row is greedy (``seeds`` unused).
        seeds: int64 ``[rows]`` on the device, the Philox key of each sampled row (any value;
            greedy rows' are unused). May be None with ``uniforms`` or without temperatures.
        uniforms: optional float32 ``[rows, vocab]`` in (0, 1) replacing the Philox draws (tests
            compare the kernel with :func:`sample_race_ref` on them).

    Returns:
        int64 ``[rows]`` token ids: greedy ``argmax(logits)`` (first index on ties, NaN as the
        maximum); sampled ``argmax(logits / T - log(-log U))``, distributed as
        ``softmax(logits / T)``.

    Raises:
        ValueError: a shape, dtype, stride or device outside the above.

    Triton (CUDA, or CPU under the interpreter): the two kernels of the module docstring, no host
    sync. Otherwise :func:`sample_race_ref` (noise from torch's CPU generator).
    """
    _check_args(logits, temperatures, seeds, uniforms)
    if not use_triton(logits):
        return sample_race_ref(logits, temperatures, seeds, uniforms)
    rows, vocab = logits.shape
    block = _INTERPRET_BLOCK if interpreted(logits) else _BLOCK
    num_chunks = cdiv(vocab, 4 * block)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    vals = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _race_chunks_kernel[(rows, num_chunks)](
        logits, temperatures, seeds, uniforms, vals, idxs, vocab, logits.stride(0),
        0 if uniforms is None else uniforms.stride(0), num_chunks, SAMPLING_EPS,
        HAS_TEMPERATURE=temperatures is not None, GIVEN_UNIFORMS=uniforms is not None, BLOCK=block, num_warps=4,
    )
    _race_merge_kernel[(rows,)](vals, idxs, out, num_chunks, BLOCK_C=next_pow2(num_chunks), num_warps=1)
    return out

"""Key offsets of an fp8 cache: keys are stored minus a constant per (layer, KV head, channel).

Attention is unchanged by a constant shift of every key a query sees: for keys ``k_j - mu``,
``q . (k_j - mu) = q . k_j - q . mu`` and ``q . mu`` is the same for every ``j``, which softmax
cancels (SageAttention's smoothing of K, Zhang et al., ICLR 2025, applies it per sequence). So the
cache may store ``k - mu`` for any ``mu`` fixed per (layer, KV head): outputs are those of the
unshifted keys in exact arithmetic, and only the log-sum-exp of a read moves (by ``q . mu``, the
same for every part of one query's keys, so merges of parts across tiers are unchanged). What
moves is the quantization error: a Qwen2-family key has channels whose values are large and
nearly constant across tokens (the key bias, which RoPE barely rotates in its low-frequency
channels); quantized with one scale per (token, KV head) they take the row's range and leave 3
mantissa bits of error on them that differs from token to token. Stored minus their mean,
those channels are near zero and every row's scale follows the part of the keys that varies.

The offset is the mean key, after RoPE, of one prefill of :data:`CALIBRATION_TOKENS` seeded
random token ids, computed once at start-up (``ModelRunner.setup``): the same on every rank, data
parallel replica and run, and independent of the requests (so outputs do not depend on what was
served first). It applies only to an fp8 cache; the store subtracts
it after RoPE, before quantizing (``TieredAttention.forward``), and every reader sees the
shifted keys: attention, QUEST's bounds, MOMENTS' and ORACLE's page scores, all invariant to
the shift as attention is, and XAttention's estimate, invariant up to the zero rows that pad its
last stride tile (they stand for keys equal to ``mu``).
"""
import torch

CALIBRATION_TOKENS = 512
"""Tokens of the calibration prefill, one sequence (``max_model_len`` where that is smaller; not
bounded by ``max_num_batched_tokens``, so that the offsets, and the outputs, do not depend on
how prompts are chunked)."""
CALIBRATION_SEED = 0
"""Seed of the calibration token ids."""


def calibration_token_ids(vocab_size: int, max_model_len: int) -> torch.Tensor:
    """The calibration prefill's token ids for an engine of ``max_model_len``: int64 ``[n]`` on the
    CPU, ``n = min(CALIBRATION_TOKENS, max_model_len)``, uniform over ``[0, vocab_size)`` from
    :data:`CALIBRATION_SEED` (the same on every rank and run)."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (min(CALIBRATION_TOKENS, max_model_len),), generator=generator)

"""Where one decode layer reads its blocks once a sparse policy picked them on the device.

QUEST over the tiered KV cache (``nanovllm/kvcache/selection.py``) picks ``k`` blocks per
choosing sequence and layer on the device; the picks must become, without a host round trip:

- the *gather list*: each picked host-tier block that cannot be read in place (not in the GPU
  tier nor in the reuse cache: a *miss*) gets a destination row. Misses are numbered in
  (sequence, pick) order; miss ``n`` goes to the layer's victim row ``n`` while victims last,
  else to a staging row (staging row ``n - max(victims, misses of the sequences before its
  group)``, so that groups of sequences reuse the staging rows one after the other);
- the paged decode kernel's block table of each sequence: its fixed GPU-tier blocks and the row of
  every pick, in logical block order, -1 padded, and its context length (read blocks x block
  size - the unwritten tokens of its last block). Sequences that do not choose keep the table
  they were given, offset to the layer's rows.

:func:`selected_reads` does it in one Triton launch (a program per batch row), so that a layer
costs one launch here instead of ~30 small torch ops whose launches the host would serialise
(eager decode). :func:`pick_rows` and :func:`selected_reads_ref` are the torch reference, also
used on the host to replay a step (``DecodeSelection.replay``).
"""

import torch
import torch.nn.functional as F

from ._triton import interpreted, next_pow2, row_tile, tl, triton, use_triton


def pick_rows(picks: torch.Tensor, in_place: torch.Tensor, victims: torch.Tensor, num_victims: torch.Tensor,
              group_first: torch.Tensor, staging_base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each pick of one layer is read (torch ops on the picks' device, no host sync); with a
    leading dimension on every argument but ``group_first``, of several layers at once.

    Args:
        picks: int64 ``[S, k]`` logical blocks, -1 for none.
        in_place: int64 ``[S, W]`` the row each block can be read from in place (GPU-tier block or
            reuse-cache row), -1 for the rest.
        victims: int64 ``[V >= 1]`` the layer's victim rows (``num_victims`` of them, 0-dim int64).
        group_first: int64 ``[S]`` the first sequence of each sequence's group.
        staging_base: the row of staging row 0.

    Returns:
        ``(rows, miss)``: int64 ``[S, k]`` the row each pick is read from (-1 for no pick) and
        bool ``[S, k]`` the picks to gather into their row first (numbered as the module doc says).
    """
    valid = picks >= 0
    found = in_place.gather(-1, picks.clamp(min=0))
    miss = valid & (found < 0)
    count = miss.long()
    number = count.flatten(-2).cumsum(-1).view_as(count) - count
    per_seq = count.sum(-1)
    before = (per_seq.cumsum(-1) - per_seq)[..., group_first]
    victim = victims.gather(-1, number.clamp(max=victims.shape[-1] - 1).flatten(-2)).view_as(number)
    staging = staging_base + number - torch.maximum(before, num_victims[..., None])[..., None]
    dest = torch.where(number < num_victims[..., None, None], victim, staging)
    return torch.where(miss, dest, found).masked_fill(~valid, -1), miss


def _check_selected_reads_args(picks, in_place, host_ids, fixed_read, victims, num_victims, layer, group_first,
                               free_tokens, other_tables, other_lens, choice) -> None:
    num_layers, num_seqs, width = in_place.shape if in_place.dim() == 3 else (0, 0, 0)
    if picks.dim() != 2 or in_place.dim() != 3 or picks.shape[0] != num_seqs:
        raise ValueError(f"picks must be [S, k] and in_place [L, S, W]; got {tuple(picks.shape)} and "
                         f"{tuple(in_place.shape)}")
    if host_ids.shape != (num_seqs, width) or fixed_read.shape != (num_seqs, width):
        raise ValueError(f"host_ids and fixed_read must be [S={num_seqs}, W={width}]; got {tuple(host_ids.shape)} "
                         f"and {tuple(fixed_read.shape)}")
    if fixed_read.dtype != torch.bool:
        raise ValueError(f"fixed_read must be bool, got {fixed_read.dtype}")
    if victims.dim() != 2 or victims.shape[0] != num_layers or victims.shape[1] < 1 or num_victims.shape != (
            num_layers,):
        raise ValueError(f"victims must be [L={num_layers}, V >= 1] and num_victims [L]; got {tuple(victims.shape)} "
                         f"and {tuple(num_victims.shape)}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer} is outside 0..{num_layers - 1}")
    if group_first.shape != (num_seqs,) or free_tokens.shape != (num_seqs,):
        raise ValueError(f"group_first and free_tokens must be [S={num_seqs}]; got {tuple(group_first.shape)} and "
                         f"{tuple(free_tokens.shape)}")
    batch = choice.shape[0] if choice.dim() == 1 else -1
    if other_tables.dim() != 2 or other_tables.shape[0] != batch or other_lens.shape != (batch,):
        raise ValueError(f"other_tables must be [B, TW] and other_lens [B] with B = len(choice) = {batch}; got "
                         f"{tuple(other_tables.shape)} and {tuple(other_lens.shape)}")
    for name, t in (("picks", picks), ("in_place", in_place), ("host_ids", host_ids), ("victims", victims),
                    ("num_victims", num_victims), ("group_first", group_first), ("free_tokens", free_tokens),
                    ("other_tables", other_tables), ("other_lens", other_lens), ("choice", choice)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")


def selected_reads_ref(picks, in_place, host_ids, fixed_read, victims, num_victims, layer: int, group_first,
                       free_tokens, staging_base: int, block_size: int, other_tables, other_lens, other_offset: int,
                       choice):
    """Reference of :func:`selected_reads` (same arguments and result, torch ops)."""
    _check_selected_reads_args(picks, in_place, host_ids, fixed_read, victims, num_victims, layer, group_first,
                               free_tokens, other_tables, other_lens, choice)
    in_place, victims, num_victims = in_place[layer], victims[layer], num_victims[layer]
    rows, miss = pick_rows(picks, in_place, victims, num_victims, group_first, staging_base)
    src = torch.where(miss, host_ids.gather(1, picks.clamp(min=0)), -1)
    width = in_place.shape[1]
    loc = torch.where(fixed_read, in_place, -1)
    dump = torch.where(picks >= 0, picks, width)  # column ``width``: no pick
    loc = torch.cat([loc, loc.new_full((loc.shape[0], 1), -1)], 1).scatter(1, dump, rows)[:, :width]
    read = loc >= 0
    table_width = other_tables.shape[1]
    if read.numel() and int(read.sum(1).max()) > table_width:
        raise ValueError(f"a choosing sequence reads {int(read.sum(1).max())} blocks, more than the "
                         f"{table_width} columns of other_tables")
    position = torch.where(read, read.cumsum(1) - 1, width)
    table = loc.new_full((loc.shape[0], width + 1), -1).scatter(1, position, loc)[:, :width]
    lens = read.sum(1) * block_size - free_tokens
    table = F.pad(table, (0, max(0, table_width - width)), value=-1)[:, :table_width]
    tables = torch.where(other_tables >= 0, other_tables + other_offset, -1)
    choosing = (choice >= 0).nonzero().flatten()
    tables, lens = tables.index_copy(0, choosing, table), other_lens.index_copy(0, choosing, lens)
    return src, rows, tables.int(), lens.int()


@triton.jit(do_not_specialize=["layer", "num_seqs", "num_picks", "width", "table_width", "num_victim_slots",
                               "staging_base", "other_offset"])
def _selected_reads_kernel(
    picks, in_place, host_ids, fixed_read, victims, num_victims, group_first, free_tokens, other_tables, other_lens,
    choice, src_out, rows_out, tables_out, lens_out,
    layer, num_seqs, num_picks, width, table_width, num_victim_slots, staging_base, other_offset, block_size,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_TW: tl.constexpr,
):
    """Program b: batch row b's table and length; for a choosing row, also its picks' rows and
    gather sources (its misses numbered after those of the choosing rows before it). The layer's
    slices of ``in_place``, ``victims`` and ``num_victims`` are taken here, so that their offsets
    do not enter the specialisation key (alignment)."""
    b = tl.program_id(0).to(tl.int64)
    in_place += layer.to(tl.int64) * num_seqs * width
    victims += layer.to(tl.int64) * num_victim_slots
    num_victims += layer
    c = tl.load(choice + b)
    p = tl.arange(0, BLOCK_TW)
    if c < 0:  # a sequence that reads every block: its table, offset to the layer's rows
        t = tl.load(other_tables + b * table_width + p, mask=p < table_width, other=-1)
        tl.store(tables_out + b * table_width + p, tl.where(t >= 0, t + other_offset, -1).to(tl.int32),
                 mask=p < table_width)
        tl.store(lens_out + b, tl.load(other_lens + b).to(tl.int32))
        return
    # misses of every choosing sequence, for this one's numbering
    s = tl.arange(0, BLOCK_S)
    k = tl.arange(0, BLOCK_K)
    sk_mask = (s[:, None] < num_seqs) & (k[None, :] < num_picks)
    all_picks = tl.load(picks + s[:, None] * num_picks + k[None, :], mask=sk_mask, other=-1)
    all_found = tl.load(in_place + s[:, None] * width + tl.maximum(all_picks, 0), mask=all_picks >= 0, other=0)
    per_seq = tl.sum(((all_picks >= 0) & (all_found < 0)).to(tl.int64), 1)
    before = tl.sum(tl.where(s < c, per_seq, 0), 0)
    before_group = tl.sum(tl.where(s < tl.load(group_first + c), per_seq, 0), 0)
    # this sequence's picks
    pick = tl.load(picks + c * num_picks + k, mask=k < num_picks, other=-1)
    valid = pick >= 0
    found = tl.load(in_place + c * width + tl.maximum(pick, 0), mask=valid, other=0)
    miss = valid & (found < 0)
    count = miss.to(tl.int64)
    number = before + tl.cumsum(count, 0) - count
    nv = tl.load(num_victims)
    victim = tl.load(victims + tl.minimum(number, num_victim_slots - 1), mask=miss, other=-1)
    dest = tl.where(number < nv, victim, staging_base + number - tl.maximum(before_group, nv))
    rows = tl.where(valid, tl.where(miss, dest, found), -1)
    src = tl.where(miss, tl.load(host_ids + c * width + tl.maximum(pick, 0), mask=miss, other=-1), -1)
    tl.store(rows_out + c * num_picks + k, rows, mask=k < num_picks)
    tl.store(src_out + c * num_picks + k, src, mask=k < num_picks)
    # its table: fixed GPU-tier blocks and picked rows, in logical order
    j = tl.arange(0, BLOCK_W)
    j_mask = j < width
    fixed = tl.load(fixed_read + c * width + j, mask=j_mask, other=0) != 0
    loc = tl.where(fixed, tl.load(in_place + c * width + j, mask=j_mask, other=-1), -1)
    picked = tl.max(tl.where(pick[:, None] == j[None, :], rows[:, None], -1), 0)
    loc = tl.where(j_mask, tl.maximum(loc, picked), -1)
    read = loc >= 0
    position = tl.cumsum(read.to(tl.int32), 0) - 1
    num_read = tl.sum(read.to(tl.int32), 0)
    tl.store(tables_out + b * table_width + position, loc.to(tl.int32), mask=read & (position < table_width))
    tl.store(tables_out + b * table_width + p, tl.full([BLOCK_TW], -1, tl.int32),
             mask=(p >= num_read) & (p < table_width))
    tl.store(lens_out + b, (num_read * block_size - tl.load(free_tokens + c)).to(tl.int32))


def selected_reads(picks: torch.Tensor, in_place: torch.Tensor, host_ids: torch.Tensor, fixed_read: torch.Tensor,
                   victims: torch.Tensor, num_victims: torch.Tensor, layer: int, group_first: torch.Tensor,
                   free_tokens: torch.Tensor, staging_base: int, block_size: int, other_tables: torch.Tensor,
                   other_lens: torch.Tensor, other_offset: int, choice: torch.Tensor):
    """The gather list and block tables of one decode layer from its picks (see the module doc).

    Args (int64 device tensors unless said; S choosing sequences, B batch rows, W = blocks of the
    longest choosing sequence, TW >= the most blocks a batch row reads: a choosing row's fixed
    blocks read in place plus its picks, a row that does not choose its table):
        picks: ``[S, k]`` picked logical blocks of ``layer``, -1 for none.
        in_place: ``[L, S, W]`` per layer, the row each block is read from in place (-1: not in
            the GPU tier nor the reuse cache).
        host_ids: ``[S, W]`` each block's host-tier block (-1: none).
        fixed_read: bool ``[S, W]``, the fixed blocks read in place (GPU tier).
        victims, num_victims: ``[L, V >= 1]`` and ``[L]``, each layer's victim rows, the first
            ``num_victims[layer]`` of them valid.
        layer: the layer whose rows are read (``0 <= layer < L``).
        group_first: ``[S]`` the first sequence of each sequence's group.
        free_tokens: ``[S]`` unwritten tokens of each sequence's last block.
        staging_base: row of staging row 0. block_size: tokens per block.
        other_tables, other_lens: ``[B, TW]`` (-1 padded) and ``[B]``, the tables and lengths of
            the rows that do not choose (rows that choose are ignored), ``other_offset`` added to
            their entries.
        choice: ``[B]``, each batch row's choosing index (its row in ``picks``), -1 for none;
            choosing rows in increasing order.

    Returns:
        ``(src, rows, tables, lens)``: int64 ``[S, k]`` host block to gather for each pick (-1:
        none) and the row it is read from (-1: no pick); int32 ``[B, TW]`` block tables and ``[B]``
        context lengths, as :func:`nanovllm.ops.decode_attention` takes them.

    Raises:
        ValueError: shapes that disagree, a layer out of range, a non-bool ``fixed_read`` or
            non-int64 ids; the reference also a choosing row reading more than TW blocks. The
            kernel cannot raise: given too narrow a table it would drop a row's last reads
            (``DecodeSelection`` sizes TW by the policy's ``max_decode_picks``, which bounds a
            row's valid picks). Values are not range-checked.

    CUDA: one Triton launch, a program per batch row (each choosing program also counts the
    misses of the rows before it: ``S x k`` loads), no host sync. Its tiles are the next powers of
    two of S and k and :func:`~nanovllm.ops._triton.row_tile` of W and TW, so it compiles once per
    octave of the choosing batch (like the decode CUDA graphs' batch sizes) and of the width.
    Elsewhere: :func:`selected_reads_ref`, whose numbers it equals exactly (integers).
    """
    _check_selected_reads_args(picks, in_place, host_ids, fixed_read, victims, num_victims, layer, group_first,
                               free_tokens, other_tables, other_lens, choice)
    if not use_triton(picks):
        return selected_reads_ref(picks, in_place, host_ids, fixed_read, victims, num_victims, layer, group_first,
                                  free_tokens, staging_base, block_size, other_tables, other_lens, other_offset,
                                  choice)
    (num_seqs, num_picks), width, (batch, table_width) = picks.shape, in_place.shape[2], other_tables.shape
    src = torch.empty_like(picks)
    rows = torch.empty_like(picks)
    tables = torch.empty((batch, table_width), dtype=torch.int32, device=picks.device)
    lens = torch.empty(batch, dtype=torch.int32, device=picks.device)
    interpret = interpreted(picks)
    _selected_reads_kernel[(batch,)](
        picks.contiguous(), in_place.contiguous(), host_ids.contiguous(), fixed_read.contiguous().view(torch.int8),
        victims.contiguous(), num_victims.contiguous(), group_first.contiguous(), free_tokens.contiguous(),
        other_tables.contiguous(), other_lens.contiguous(), choice.contiguous(), src, rows, tables, lens,
        layer, num_seqs, num_picks, width, table_width, victims.shape[1], staging_base, other_offset, block_size,
        BLOCK_S=next_pow2(num_seqs), BLOCK_K=next_pow2(num_picks), BLOCK_W=row_tile(width, interpret),
        BLOCK_TW=row_tile(table_width, interpret),
    )
    return src, rows, tables, lens

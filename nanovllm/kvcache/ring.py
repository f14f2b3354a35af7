"""The ring buffer decode reads host-tier blocks through: a step's loads, in groups of slots.

Each decode layer reads a list of host-tier blocks, ``(batch row, host block)`` loads in order
(``Context.host_loads``, a sliding window's ``WindowReads``, or a choosing policy's
``DecodeSelection.ring_loads``), each from a token on (``skips``: a window's first block, else 0).
The ring's ``N`` GPU slots (``host_tier.py``) are two halves of ``G = N // 2`` slots. A step's loads
are cut, layer by layer, into groups of at most ``G`` loads of one layer, and group ``k`` of the
step goes to half ``k % 2``:

    transfer stream:  wait half free -> one copy per run of consecutive host blocks -> half ready
    compute stream:   wait half ready -> fold the group into its rows' (out, lse) -> half free

Group ``k + 1`` loads while group ``k`` is folded, across layer boundaries: the plan is the whole
step's, so the next layer's first group loads while this layer computes. A group is folded by one
paged decode over its half, each row of the batch reading its slots in the group as its block table
(``decode_attention`` with LSE; a window's first block from its window start through
``context_starts``; rows without loads in the group read nothing), and one LSE merge
(``merge_attention_outputs``) into the running state; a group of one load by
``decode_attend_merge``, one launch. So a layer costs two or three launches and a copy per run per
``G`` host blocks, not a launch and a copy per block: small blocks (a small model's KV, a few KiB
per token) are read at the link's pace instead of the host's.

The tables of a load list's groups do not depend on the layer (slots are counted from the half's
first), so each distinct list of the step (one for every layer without a window) is cut and its
tables copied to the device once per step.
"""
from dataclasses import dataclass

import torch

from nanovllm.kvcache.host_tier import HostTier
from nanovllm.ops import decode_attend_merge, decode_attention, merge_attention_outputs
from nanovllm.utils.tensors import padded_rows, to_device


@dataclass
class GroupTables:
    """The block tables of one group of loads over its ring half (``decode_attention``'s
    arguments): ``block_tables`` int32 ``[B, W]`` (each row's slots in the group, counted from the
    half's first, -1 padded), ``context_lens`` int32 ``[B]`` (its tokens in them), ``context_starts``
    int32 ``[B]`` (its tokens before a window's start; None when no load skips any)."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    context_starts: torch.Tensor | None


@dataclass
class RingGroup:
    """Loads ``loads`` (``(batch row, host block)``, in order) of ``layer``, read from token
    ``skips[i]`` on, into ring half ``half`` from its first slot; ``tables`` for a group of more
    than one load."""

    layer: int
    half: int
    loads: list[tuple[int, int]]
    skips: list[int]
    tables: GroupTables | None


def cut_groups(loads: list[tuple[int, int]], skips: list[int], size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each group of ``loads``: at most ``size`` loads, a new group where a
    load that skips tokens is not its row's first in the group (a row's table has one start)."""
    groups, start, rows = [], 0, set()
    for i, ((row, _), skip) in enumerate(zip(loads, skips)):
        if i - start == size or (skip and row in rows):
            groups.append((start, i))
            start, rows = i, set()
        rows.add(row)
    if start < len(loads):
        groups.append((start, len(loads)))
    return groups


def group_tables(loads: list[tuple[int, int]], skips: list[int], block_size: int, batch: int,
                 device: torch.device) -> GroupTables:
    """The tables of one group (see :class:`GroupTables`)."""
    tables: list[list[int]] = [[] for _ in range(batch)]
    starts = [0] * batch
    for slot, ((row, _), skip) in enumerate(zip(loads, skips)):
        if not tables[row]:
            starts[row] = skip
        tables[row].append(slot)
    width = max(map(len, tables))
    return GroupTables(to_device(padded_rows(tables, width), torch.int32, device),
                       to_device([len(t) * block_size for t in tables], torch.int32, device),
                       to_device(starts, torch.int32, device) if any(skips) else None)


class RingReader:
    """Reads a step's host blocks through the ring of ``tier`` (module doc): :meth:`reset` with the
    step's loads per layer, then :meth:`fold` once per layer, in order."""

    def __init__(self, tier: HostTier):
        self.tier = tier
        self.group_size = max(1, tier.num_slots // 2)
        self.groups: list[RingGroup] = []
        self.issued = self.consumed = 0

    def reset(self, layer_reads: list[tuple[list[tuple[int, int]], list[int] | None]], batch: int):
        """A new step: ``layer_reads[l]`` is layer ``l``'s ``(loads, skips)`` (skips None: whole
        blocks) for a batch of ``batch`` rows; the first two groups start loading now."""
        cut: dict[int, list[tuple[int, int, GroupTables | None]]] = {}
        self.groups, self.issued, self.consumed = [], 0, 0
        block_size, device = self.tier.block_size, self.tier.device
        for layer, (loads, skips) in enumerate(layer_reads):
            skips = skips or [0] * len(loads)
            if id(loads) not in cut:  # one list shared by many layers: cut and tabled once
                cut[id(loads)] = [(start, stop, None if stop - start == 1 else
                                   group_tables(loads[start:stop], skips[start:stop], block_size, batch, device))
                                  for start, stop in cut_groups(loads, skips, self.group_size)]
            for start, stop, tables in cut[id(loads)]:
                self.groups.append(RingGroup(layer, len(self.groups) % 2, loads[start:stop], skips[start:stop], tables))
        self._issue()

    def _issue(self):
        while self.issued < min(len(self.groups), self.consumed + 2):
            group = self.groups[self.issued]
            self.tier.load(group.half, group.half * self.group_size, group.layer, [h for _, h in group.loads])
            self.issued += 1

    def fold(self, layer: int, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold ``layer``'s host blocks into the running state: q ``[B, Hq, D]``, out float32 ``[B,
        Hq, D]`` and lse float32 ``[B, Hq]`` over the keys read so far -> the state over those and
        the layer's planned loads (out and lse may be updated in place or replaced)."""
        while self.consumed < len(self.groups) and self.groups[self.consumed].layer == layer:
            group = self.groups[self.consumed]
            self.tier.wait(group.half)
            k, v, k_scale, v_scale = self.tier.slots(group.half * self.group_size, len(group.loads))
            if group.tables is None:  # one block
                (row, _), skip = group.loads[0], group.skips[0]
                scales = (None, None) if k_scale is None else (k_scale[0, skip:], v_scale[0, skip:])
                decode_attend_merge(q[row], k[0, skip:], v[0, skip:], out[row], lse[row], scale, *scales)
            else:
                t = group.tables
                scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
                group_out, group_lse = decode_attention(q, k, v, t.block_tables, t.context_lens, scale, return_lse=True,
                                                        context_starts=t.context_starts, **scales)
                merged, merged_lse = merge_attention_outputs(out[:, None], lse[:, :, None], group_out[:, None],
                                                             group_lse[:, :, None])
                out, lse = merged[:, 0], merged_lse[:, :, 0]
            self.tier.release(group.half)
            self.consumed += 1
            self._issue()
        return out, lse

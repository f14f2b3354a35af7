"""The host tier's ring (nanovllm/kvcache/ring.py): copies per run of blocks, groups of loads per
ring half, and each group folded into the running attention state by one paged read."""
import pytest
import torch

from nanovllm.kvcache.eviction import BlockMove
from nanovllm.kvcache.host_tier import HostTier, copy_runs
from nanovllm.kvcache.ring import RingReader, cut_groups, group_tables
from nanovllm.kvcache.sizing import MIN_RING_SLOTS, RING_BYTES, KVGeometry, ring_slots
from nanovllm.ops import decode_attention_ref

LAYERS, BLOCK, HEADS_Q, HEADS_KV, DIM = 2, 16, 4, 2, 8


def test_copy_runs_join_consecutive_blocks_inside_one_registration():
    pairs = [(0, 5), (1, 6), (2, 7), (3, 2), (4, 3), (6, 4), (7, 8), (8, 9)]
    assert copy_runs(pairs, None) == [(0, 5, 3), (3, 2, 2), (6, 4, 1), (7, 8, 2)]
    # registrations of 4 blocks: 5,6,7 | 8,9 and 2,3 | 4
    assert copy_runs(pairs, 4) == [(0, 5, 3), (3, 2, 2), (6, 4, 1), (7, 8, 2)]
    assert copy_runs([(0, 3), (1, 4), (2, 5)], 4) == [(0, 3, 1), (1, 4, 2)], "cut at block 4"
    assert copy_runs([], None) == []


def test_groups_hold_at_most_half_the_ring_and_one_start_per_row():
    loads = [(0, 1), (0, 2), (1, 3), (1, 4), (1, 5), (2, 6)]
    assert cut_groups(loads, [0] * 6, 4) == [(0, 4), (4, 6)]
    assert cut_groups(loads, [0] * 6, 1) == [(i, i + 1) for i in range(6)]
    # a skipping load that is not its row's first in the group starts a new group
    assert cut_groups(loads, [0, 3, 0, 0, 0, 0], 8) == [(0, 1), (1, 6)]
    assert cut_groups(loads, [5, 0, 7, 0, 0, 2], 8) == [(0, 6)], "each skip is its row's first load"


def test_group_tables_count_slots_from_the_half():
    loads, skips = [(2, 9), (0, 4), (2, 10)], [3, 0, 0]
    t = group_tables(loads, skips, BLOCK, 4, torch.device("cpu"))
    assert t.block_tables.tolist() == [[1, -1], [-1, -1], [0, 2], [-1, -1]]
    assert t.context_lens.tolist() == [BLOCK, 0, 2 * BLOCK, 0]
    assert t.context_starts.tolist() == [0, 0, 3, 0]
    assert group_tables(loads, [0, 0, 0], BLOCK, 4, torch.device("cpu")).context_starts is None


def test_default_ring_fills_its_bytes():
    small = KVGeometry(24, 2, 64, 256, torch.bfloat16, 2 * 2 * 64 * 2)  # Qwen2.5-0.5B: 128 KiB a layer-block
    assert ring_slots(None, small) == RING_BYTES // (256 * 512) == 1024
    big = KVGeometry(32, 8, 128, 4096, torch.bfloat16, 2 * 8 * 128 * 2)  # Llama-3.1-8B, 4096-token blocks
    assert ring_slots(None, big) == RING_BYTES // (16 << 20) == 8
    huge = KVGeometry(80, 8, 128, 16384, torch.bfloat16, 2 * 8 * 128 * 2)  # 64 MiB a layer-block
    assert ring_slots(None, huge) == MIN_RING_SLOTS
    assert ring_slots(3, small) == 3


def test_moves_copied_in_one_call_equal_moves_copied_one_by_one():
    """A step's moves in one call (write-backs, then load-backs into blocks one of them read, then
    a write-back of a block loaded back) give the contents moves one at a time give."""
    gen = torch.Generator().manual_seed(1)
    moves = [BlockMove(0, 2, True), BlockMove(1, 3, True), BlockMove(2, 4, True), BlockMove(0, 3, False),
             BlockMove(1, 4, False), BlockMove(3, 0, True), BlockMove(0, 5, True), BlockMove(2, 6, True, ahead=True)]
    results = []
    for chunks in (None, [[m] for m in moves]):
        tier = _tier(4)
        k_gpu = torch.randn(LAYERS, 4, BLOCK, HEADS_KV, DIM, generator=gen.manual_seed(2))
        v_gpu = torch.randn(LAYERS, 4, BLOCK, HEADS_KV, DIM, generator=gen.manual_seed(3))
        for part in ([moves] if chunks is None else chunks):
            tier.move(part, k_gpu, v_gpu)
        results.append((k_gpu, v_gpu, tier.k_host.clone(), tier.v_host.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert torch.equal(results[0][2][:, 6], results[0][0][:, 2]), "a write-back ahead of reuse, after the others"
    k_gpu, _, k_host, _ = results[0]
    assert torch.equal(k_gpu[:, 0], k_host[:, 3]) and torch.equal(k_host[:, 0], k_gpu[:, 3])
    assert torch.equal(k_host[:, 5], k_host[:, 3]), "the last write-back read what a load-back wrote"


def _tier(slots: int, chunk_bytes: int | None = None) -> HostTier:
    gen = torch.Generator().manual_seed(0)
    tier = HostTier(LAYERS, BLOCK, HEADS_KV, DIM, torch.float32, torch.device("cpu"), 12, slots,
                    chunk_bytes=chunk_bytes)
    tier.memory.ensure(12)
    tier.k_host.copy_(torch.randn(tier.k_host.shape, generator=gen))
    tier.v_host.copy_(torch.randn(tier.v_host.shape, generator=gen))
    return tier


def test_a_load_fills_the_slots_with_the_blocks_across_registrations():
    tier = _tier(8, chunk_bytes=2 * LAYERS * 4 * BLOCK * HEADS_KV * DIM * 4)  # 4 blocks a registration
    assert tier.memory.registration_blocks == 4
    tier.load(1, 4, 1, [2, 3, 4, 5])  # blocks 2, 3 | 4, 5: two copies per tensor
    tier.wait(1)
    k, v, k_scale, _ = tier.slots(4, 4)
    assert torch.equal(k, tier.k_host[1, 2:6]) and torch.equal(v, tier.v_host[1, 2:6]) and k_scale is None
    assert tier.bytes_h2d == 4 * tier.layer_block_bytes
    tier.free_memory()


@pytest.mark.parametrize("slots", [2, 4, 6, 16])
def test_folded_groups_equal_attention_over_the_concatenated_blocks(slots):
    """Rows of one batch with host blocks in every layer (a window's first block read from its
    window start), folded into a state that starts empty (row 3 has none): each row's output and
    LSE equal attention over its blocks' tokens, whatever the ring's size."""
    tier = _tier(slots)
    ring = RingReader(tier)
    row_blocks = {0: ([3, 4, 5], 5), 1: ([0], 0), 2: ([7, 8, 1, 2, 9], 11)}  # blocks, skip of the first
    loads = [(row, h) for row, (blocks, _) in row_blocks.items() for h in blocks]
    skips = [skip if i == 0 else 0 for _, (blocks, skip) in row_blocks.items() for i in range(len(blocks))]
    batch = 4
    ring.reset([(loads, skips), (loads[::-1][:4], None)], batch)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, HEADS_Q, DIM, generator=gen)
    for layer, layer_loads in enumerate((loads, loads[::-1][:4])):
        out = torch.zeros(batch, HEADS_Q, DIM)
        lse = torch.full((batch, HEADS_Q), float("-inf"))
        out, lse = ring.fold(layer, q, out, lse, DIM ** -0.5)
        for row in range(batch):
            blocks = [h for r, h in layer_loads if r == row]
            if not blocks:
                assert torch.equal(out[row], torch.zeros(HEADS_Q, DIM)) and torch.isneginf(lse[row]).all()
                continue
            skip = row_blocks[row][1] if layer == 0 else 0
            k = tier.k_host[layer, blocks].flatten(0, 1)[skip:][None]
            v = tier.v_host[layer, blocks].flatten(0, 1)[skip:][None]
            ref, ref_lse = decode_attention_ref(q[row:row + 1], k, v, torch.zeros(1, 1, dtype=torch.int32),
                                                torch.tensor([k.shape[1]], dtype=torch.int32), DIM ** -0.5,
                                                return_lse=True)
            torch.testing.assert_close(out[row], ref[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(lse[row], ref_lse[0], atol=1e-5, rtol=0)
    assert ring.consumed == len(ring.groups) and tier.bytes_h2d == (len(loads) + 4) * tier.layer_block_bytes
    assert len(ring.groups) == sum(len(cut_groups(l, s, max(1, slots // 2)))
                                   for l, s in ((loads, skips), (loads[::-1][:4], [0] * 4)))
    tier.free_memory()

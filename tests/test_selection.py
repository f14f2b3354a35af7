"""DecodeSelection.layer_reads against a plain-Python reading of the module's rules: per choosing
(sequence, KV head) its sink pages, its picks and its recent pages, each read in place in the GPU
tier (offset by the layer's rows) or, on the host, gathered into the next staging page of its
head; the sequences that do not choose read their GPU pages in order."""
import pytest
import torch

from nanovllm.kvcache.block_manager import NO_BLOCK
from nanovllm.kvcache.selection import DecodeSelection
from nanovllm.kvcache.tier_rows import TierRows
from nanovllm.sparse.streaming import StreamingPolicy
from nanovllm.sparse.quest import QuestPolicy

BLOCK, PAGE, HEADS, LAYERS = 64, 16, 2, 3
PPB = BLOCK // PAGE


def reference_reads(tables, choosing, picks, policy, layout, layer, first):
    """Per batch row (choosing rows first, then the others): ``(per-head page lists, length)``, and
    per KV head the host pages gathered, in order."""
    layer_page = layer * layout.layer_rows * PPB
    staging = [layout.staging_base * PPB] * HEADS
    gathered = [[] for _ in range(HEADS)]
    rows = []
    for s, r in enumerate(choosing):
        gpu, host, length = tables[r]
        num_pages = -(-length // PAGE)
        tail = policy.recent_pages + 1
        per_head = []
        for h in range(HEADS):
            logical = list(range(policy.sink_pages))
            logical += [p + first if p >= 0 else None for p in picks[s, h].tolist()]
            logical += list(range(num_pages - tail, num_pages))
            places = []
            for page in logical:
                if page is None:
                    places.append(-1)
                elif gpu[page // PPB] != NO_BLOCK:
                    places.append(gpu[page // PPB] * PPB + page % PPB + layer_page)
                else:
                    gathered[h].append(host[page // PPB] * PPB + page % PPB)
                    places.append(staging[h])
                    staging[h] += 1
            per_head.append(places)
        free = num_pages * PAGE - length
        rows.append((per_head, len(per_head[0]) * PAGE - free))
    for r, (gpu, _, length) in enumerate(tables):
        if r in choosing:
            continue
        pages = [g * PPB + j + layer_page for g in gpu if g != NO_BLOCK for j in range(PPB)][:-(-length // PAGE)]
        rows.append(([pages] * HEADS, length))
    return rows, gathered


@pytest.mark.parametrize("host", [False, True], ids=["gpu-only", "host-pages"])
@pytest.mark.parametrize("policy", [QuestPolicy(1.0, PAGE, 4 * PAGE, 16, 32), StreamingPolicy(1.0, PAGE, 16, 32)],
                         ids=["quest", "streaming"])
def test_layer_reads_follow_the_rules(host, policy):
    torch.manual_seed(0)
    # row 0 and 2 choose (long enough), row 1 reads everything; with host pages the middle blocks spill
    lengths = [5 * BLOCK - 7, 2 * BLOCK - 30, 4 * BLOCK]
    tables, next_gpu, next_host = [], 0, 0
    for length in lengths:
        blocks = -(-length // BLOCK)
        gpu, hst = [], []
        for j in range(blocks):
            spill = host and 0 < j < blocks - 1
            gpu.append(NO_BLOCK if spill else next_gpu)
            hst.append(next_host if spill else NO_BLOCK)
            next_gpu, next_host = next_gpu + (not spill), next_host + spill
        tables.append((gpu, hst, length))
    layout = TierRows(LAYERS, next_gpu + 1, 8)
    selection = DecodeSelection.build(policy, tables, layout, next_gpu, BLOCK, HEADS, torch.device("cpu"))
    choosing = selection.choosing
    if policy.budget_pages:  # row 1's 3 candidates fit QUEST's budget of 4 pages: it reads everything
        assert choosing == [0, 2] and selection.others == [1]
    else:
        assert choosing == [0, 1, 2] and selection.others == []
    cand = selection.candidates.pages
    num_picks = policy.budget_pages
    for layer in range(LAYERS):
        picks = torch.stack([torch.stack([torch.randperm(cand.shape[1])[:num_picks] for _ in range(HEADS)])
                             for _ in choosing])
        if num_picks:
            picks[0, 1, -1] = -1  # a head with a pick short
        picks = torch.where(picks < (cand[:, None, :] >= 0).sum(2, keepdim=True), picks, -1)
        reads = selection.layer_reads(layer, picks, 0, None)
        expected, gathered = reference_reads(tables, choosing, picks, policy, layout, layer, selection.candidates.first)
        for row, (per_head, length) in enumerate(expected):
            assert reads.lens[row].item() == length
            for h in range(HEADS):
                table = reads.tables[row, h].tolist()
                assert table[:len(per_head[h])] == per_head[h]
                assert all(t == -1 for t in table[len(per_head[h]):])
        if not host:
            assert reads.src is None and reads.dst is None
            continue
        src = reads.src.view(HEADS, -1)
        for h in range(HEADS):
            assert src[h][src[h] >= 0].tolist() == gathered[h]
        assert reads.misses.item() == reads.host_reads.item() == sum(map(len, gathered))


def test_a_graphs_selection_loaded_with_a_narrower_step_reads_only_that_step():
    """``DecodeSelection.for_graphs`` loaded with a wide step of 3 rows, then a narrow step of 2:
    the live rows read what the narrow step's own selection reads, and the padded row reads
    nothing even with picks that would be valid columns."""
    torch.manual_seed(1)
    policy = QuestPolicy(1.0, PAGE, 4 * PAGE, 16, 32)
    layout = TierRows(LAYERS, 64, 0)
    graph = DecodeSelection.for_graphs(policy, 3, 12 * BLOCK, layout, BLOCK, HEADS, torch.device("cpu"))

    def step(lengths, first_block):
        tables, block = [], first_block
        for length in lengths:
            blocks = -(-length // BLOCK)
            tables.append((list(range(block, block + blocks)), [NO_BLOCK] * blocks, length))
            block += blocks
        return DecodeSelection.build(policy, tables, layout, 64, BLOCK, HEADS, torch.device("cpu"))

    wide, narrow = step([12 * BLOCK - 3, 11 * BLOCK, 10 * BLOCK + 5], 0), step([3 * BLOCK - 9, 4 * BLOCK], 40)
    assert wide.graphable(False) and narrow.graphable(False)
    graph.load(wide)
    graph.load(narrow)
    num_cand = narrow.candidates.pages.shape[1]
    for layer in range(LAYERS):
        picks = torch.stack([torch.stack([torch.randperm(num_cand)[:policy.budget_pages] for _ in range(HEADS)])
                             for _ in range(2)])
        own = narrow.layer_reads(layer, picks, 0, None)
        padded = torch.cat([picks, torch.zeros(1, HEADS, policy.budget_pages, dtype=torch.int64)])
        reads = graph.layer_reads(layer, padded, 0, None)
        assert torch.equal(reads.lens[:2], own.lens) and reads.lens[2] == 0
        width = own.tables.shape[2]
        assert torch.equal(reads.tables[:2, :, :width], own.tables) and (reads.tables[2] == -1).all()
        graph.reset_plans()  # as a graph's replay recomputes them

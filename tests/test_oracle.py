"""ORACLE (nanovllm/sparse/oracle.py): decode pages chosen by their exact attention mass. The
choice against a brute-force computation, its key copies across tiers, FULL's tokens and logits
when the budget covers the context and over the host tier: tests/test_page_scorers.py."""
import pytest
import torch

from nanovllm.sparse import DecodeCandidates, OraclePolicy


def _policy(**kw):
    opts = dict(page_size=16, budget_tokens=48, sink_tokens=16, recent_tokens=16)
    opts.update(kw)
    return OraclePolicy(0.3, **opts)


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_picks_are_the_pages_with_the_most_attention_mass(combine):
    """Per KV head: each query head's softmax over every key of the candidates, summed per page,
    combined over the group (max or sum); the budget's best pages, best first."""
    policy = _policy(group_score=combine)
    layers, blocks, block, heads_kv, heads_q, dim = 2, 3, 64, 2, 6, 8
    policy.allocate(layers, block, heads_kv, dim, torch.float32, torch.device("cpu"), blocks, 0)
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(layers, blocks, block, heads_kv, dim, generator=gen) * 2
    policy.on_pages_full(keys, torch.arange(blocks))
    pages = torch.tensor([[1, 2, 3, 5, 6, 7, 9, 10, 11], [4, 5, 6, 8, -1, -1, -1, -1, -1]])
    q = torch.randn(2, heads_q, dim, generator=gen)
    picks = policy.select_decode_pages(1, q, DecodeCandidates([0, 1], pages, first=1, num_kv_heads=heads_kv))
    page_keys = keys[1].reshape(blocks * block // 16, 16, heads_kv, dim)
    group = heads_q // heads_kv
    for s in range(2):
        valid = [p for p in pages[s].tolist() if p >= 0]
        for h in range(heads_kv):
            shares = []
            for g in range(group):
                logits = torch.stack([page_keys[p, :, h] @ q[s, h * group + g] for p in valid]) * 0.3  # [C, 16]
                shares.append(torch.softmax(logits.flatten(), 0).view(len(valid), 16).sum(1))
            shares = torch.stack(shares)
            score = shares.amax(0) if combine == "max" else shares.sum(0)
            expected = score.topk(min(3, len(valid))).indices.tolist()
            got = [c for c in picks[s, h].tolist() if c >= 0]
            assert sorted(got) == sorted(expected), (s, h)
    assert (picks[1] >= 0).sum(1).tolist() == [3, 3] and picks.shape == (2, heads_kv, 3)


def test_key_copies_follow_their_blocks_between_tiers():
    policy = _policy()
    policy.allocate(2, 64, 2, 8, torch.float32, torch.device("cpu"), 3, 4)
    keys = torch.randn(2, 1, 64, 2, 8)
    policy.on_pages_full(keys, torch.tensor([1]))
    assert torch.equal(policy.keys[:, 1].flatten(1, 2), keys[:, 0])
    policy.on_spill(torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(policy.keys[:, 3 + 2], policy.keys[:, 1]), "host block 2 is metadata slot 3 + 2"
    policy.on_load(torch.tensor([2]), torch.tensor([0]))
    assert torch.equal(policy.keys[:, 0], policy.keys[:, 1])
    assert policy.metadata_bytes_per_block(2, 64, 2, 8, torch.float32) == 2 * 64 * 2 * 8 * 4

"""MOMENTS (nanovllm/sparse/moments.py): decode pages chosen by a Gaussian estimate of their
attention mass from their keys' mean and variance. The estimate and the choice against a direct
computation, the moments across tiers, FULL's tokens and logits when the budget covers the
context and over the host tier: tests/test_page_scorers.py."""
import pytest
import torch

from nanovllm.sparse import DecodeCandidates, MomentsPolicy


def _policy(**kw):
    opts = dict(page_size=16, budget_tokens=48, sink_tokens=16, recent_tokens=16)
    opts.update(kw)
    return MomentsPolicy(0.3, **opts)


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_picks_follow_the_gaussian_estimate_of_each_pages_log_sum_exp(combine):
    """A page's logit is ``s q . mu + s^2 (q^2 . var) / 2`` from its keys' mean and (population)
    variance; per query head a softmax over the candidates, combined over the group."""
    policy = _policy(group_score=combine)
    layers, blocks, block, heads_kv, heads_q, dim = 2, 3, 64, 2, 6, 8
    policy.allocate(layers, block, heads_kv, dim, torch.float32, torch.device("cpu"), blocks, 0)
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(layers, blocks, block, heads_kv, dim, generator=gen) * torch.rand(dim, generator=gen) * 2
    policy.on_pages_full(keys, torch.arange(blocks))
    pages = torch.tensor([[1, 2, 3, 5, 6, 7, 9, 10, 11], [4, 5, 6, 8, -1, -1, -1, -1, -1]])
    q = torch.randn(2, heads_q, dim, generator=gen)
    picks = policy.select_decode_pages(1, q, DecodeCandidates([0, 1], pages, first=1, num_kv_heads=heads_kv))
    page_keys = keys[1].reshape(blocks * block // 16, 16, heads_kv, dim)
    group, s = heads_q // heads_kv, 0.3
    for row in range(2):
        valid = [p for p in pages[row].tolist() if p >= 0]
        for h in range(heads_kv):
            shares = []
            for g in range(group):
                qh = q[row, h * group + g]
                mu = torch.stack([page_keys[p, :, h].mean(0) for p in valid])
                var = torch.stack([page_keys[p, :, h].var(0, correction=0) for p in valid])
                logits = s * (mu @ qh) + s * s * (var @ (qh * qh)) / 2
                shares.append(torch.softmax(logits, 0))
            shares = torch.stack(shares)
            score = shares.amax(0) if combine == "max" else shares.sum(0)
            expected = score.topk(min(3, len(valid))).indices.tolist()
            assert sorted(c for c in picks[row, h].tolist() if c >= 0) == sorted(expected), (row, h)


def test_the_estimate_is_exact_for_gaussian_keys_in_expectation():
    """For keys drawn from N(mu, diag(var)), log mean_n exp(s q . k_n) tends to the estimate."""
    gen = torch.Generator().manual_seed(0)
    mu, sd, q, s = torch.randn(8, generator=gen), torch.rand(8, generator=gen), torch.randn(8, generator=gen), 0.3
    keys = mu + sd * torch.randn(400_000, 8, generator=gen)
    empirical = torch.logsumexp(s * keys @ q, 0) - torch.log(torch.tensor(400_000.0))
    assert empirical.item() == pytest.approx((s * mu @ q + s * s * (sd * sd) @ (q * q) / 2).item(), abs=0.01)


def test_moments_follow_their_blocks_between_tiers():
    policy = _policy()
    policy.allocate(2, 64, 2, 8, torch.float32, torch.device("cpu"), 3, 4)
    keys = torch.randn(2, 1, 64, 2, 8)
    policy.on_pages_full(keys, torch.tensor([1]))
    pages = keys[:, 0].view(2, 4, 16, 2, 8)
    assert torch.allclose(policy.mean[:, 1], pages.mean(2))
    assert torch.allclose(policy.var[:, 1], pages.var(2, correction=0))
    policy.on_spill(torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(policy.var[:, 3 + 2], policy.var[:, 1]), "host block 2 is metadata slot 3 + 2"
    policy.on_load(torch.tensor([2]), torch.tensor([0]))
    assert torch.equal(policy.mean[:, 0], policy.mean[:, 1])
    assert policy.metadata_bytes_per_block(2, 64, 2, 8, torch.float32) == 2 * 2 * 4 * 2 * 8 * 4

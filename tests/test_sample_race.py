"""The fused sampling kernel (nanovllm.ops.sample_race) and the Sampler's fused path.

CPU tests check the reference against plain float64 math, the argument errors, and that the
engine's Sampler keeps the torch path on CPU. The ``test_interpreted_*`` tests run the Triton
kernels on CPU tensors through Triton's interpreter, in a child pytest started by
``test_triton_kernels_under_interpreter`` (the interpreter is slow: a few hundred rows at most).
"""

import pytest
import torch

from _interpreter import eager_only, interpreted_only, run_interpreted_tests

from nanovllm.layers import sampler as sampler_module
from nanovllm.layers.sampler import Penalties, Sampler, SamplingTensors, temperature_only
from nanovllm.ops import sample_race, sample_race_ref


def race_inputs(rows, vocab, seed, dtype=torch.float32, pad=0):
    """Logits ``[rows, vocab]`` (a row stride of ``vocab + pad``), temperatures with greedy rows
    (0) every third row, uniforms in (0, 1). No near-ties: each row's winner is raised by 0.1
    (so the kernel's and the reference's float rounding cannot pick different tokens)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab + pad, generator=gen) * 2).to(dtype)[:, :vocab]
    temperatures = torch.rand(rows, generator=gen) * 1.5 + 0.2
    temperatures[::3] = 0.0
    uniforms = torch.rand(rows, vocab, generator=gen).clamp(1e-6, 1 - 1e-6)
    winners = race_scores(logits, temperatures, uniforms).argmax(-1)
    logits[torch.arange(rows), winners] += 0.1
    top = race_scores(logits, temperatures, uniforms).topk(2, dim=-1).values
    assert bool((top[:, 0] - top[:, 1] > 1e-2).all())
    return logits, temperatures, uniforms


def race_scores(logits, temperatures, uniforms) -> torch.Tensor:
    """float64 scores: the logits on greedy rows, log(softmax(logits / T) / E), E = -log U, on
    sampled rows (the exponential race of today's sampler, in logs)."""
    logits = logits.double()
    sampled = (temperatures >= 1e-5).unsqueeze(1)
    race = (logits / temperatures.double().unsqueeze(1)).log_softmax(-1) - torch.log(-torch.log(uniforms.double()))
    return torch.where(sampled, race, logits)


def chi_square(tokens, probs) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def plain_params(temperatures, generators=None) -> SamplingTensors:
    """Temperature-only SamplingTensors (greedy rows: temperature 0 given, 1.0 stored)."""
    sampled = (temperatures >= 1e-5).nonzero().squeeze(1).tolist()
    return SamplingTensors(temperatures.where(temperatures >= 1e-5, 1.0) if sampled else None, None, None, None,
                           sampled_rows=sampled, generators=generators or {})


# ---------------------------------------------------------------- CPU: reference and dispatch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_exponential_race_and_greedy_argmax(dtype):
    logits, temperatures, uniforms = race_inputs(9, 300, seed=1, dtype=dtype, pad=7)
    scores = race_scores(logits, temperatures, uniforms)
    tokens = sample_race_ref(logits, temperatures, None, uniforms)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, scores.argmax(-1))
    assert torch.equal(sample_race_ref(logits, None, None), logits.float().argmax(-1))


def test_reference_draws_follow_the_seeds():
    logits = torch.zeros(4, 1000)
    temperatures, seeds = torch.ones(4), torch.tensor([5, 5, 6, 7])
    tokens = sample_race_ref(logits, temperatures, seeds).tolist()
    assert tokens == sample_race_ref(logits, temperatures, seeds).tolist()
    assert tokens[0] == tokens[1] and len(set(tokens[1:])) == 3


def test_errors_name_the_argument_and_the_value():
    logits = torch.randn(3, 50)
    cases = [
        (dict(logits=torch.randn(50)), "logits must be"),
        (dict(logits=torch.randn(3, 50).double()), "float64"),
        (dict(logits=torch.randn(50, 3).t()), "contiguous vocab"),
        (dict(logits=torch.randn(3, 0)), "vocab dimension >= 1"),
        (dict(temperatures=torch.ones(4)), r"temperatures must be float32 \[3\]"),
        (dict(seeds=torch.ones(3, dtype=torch.int32)), r"seeds must be int64 \[3\]"),
        (dict(seeds=None), "need seeds"),
        (dict(uniforms=torch.rand(3, 49)), "uniforms must be float32"),
    ]
    for change, message in cases:
        args = {"logits": logits, "temperatures": torch.ones(3), "seeds": torch.zeros(3, dtype=torch.int64), **change}
        for fn in (sample_race, sample_race_ref):
            with pytest.raises(ValueError, match=message):
                fn(args["logits"], args["temperatures"], args["seeds"], args.get("uniforms"))


def test_temperature_only_reads_the_host_flags():
    temps = torch.ones(2)
    assert temperature_only(plain_params(temps))
    ids = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    for change in (dict(top_k=torch.ones(2), top_p=torch.ones(2)), dict(min_p=torch.ones(2)), dict(banned=ids),
                   dict(logprob_rows=[1], num_logprobs=2),
                   dict(penalties=Penalties(temps, temps, temps, ids, ids))):
        params = plain_params(temps)
        for name, value in change.items():
            setattr(params, name, value)
        assert not temperature_only(params), change


@eager_only
def test_cpu_sampler_keeps_the_torch_path(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the fused kernel ran on CPU")

    monkeypatch.setattr(sampler_module, "sample_race", fail)
    logits = torch.randn(4, 100)
    temperatures = torch.tensor([0.0, 0.8, 1.0, 0.0])
    for fused in (None, True):
        tokens = Sampler(fused=fused)(logits, plain_params(temperatures)).tokens
        assert torch.equal(tokens[[0, 3]], logits[[0, 3]].argmax(-1))


# ---------------------------------------------------------------- Triton interpreter
@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interpreted_kernel_matches_reference_given_uniforms(dtype):
    # 203 tokens: three full 64-token chunks (4 blocks of 16) and a partial one; strided rows
    logits, temperatures, uniforms = race_inputs(12, 203, seed=10, dtype=dtype, pad=5)
    tokens = sample_race(logits, temperatures, None, uniforms)
    assert tokens.dtype == torch.int64
    expected = sample_race_ref(logits, temperatures, None, uniforms)
    assert torch.equal(tokens, expected)
    untempered = sample_race_ref(logits, (temperatures > 0).float(), None, uniforms)
    assert (untempered != expected).sum() >= 2  # the inputs tell a kernel ignoring T apart


@interpreted_only
def test_interpreted_greedy_rows_are_exact_argmax_with_first_index_on_ties():
    logits = torch.randn(5, 150).bfloat16()
    logits[0, [3, 70, 149]] = 9.0  # ties within a block, across chunks
    logits[1, [129, 140]] = 9.0
    logits[2] = float("-inf")
    logits[3, [20, 90]] = float("nan")  # torch.argmax: the first NaN
    assert torch.equal(sample_race(logits, None, None), logits.argmax(-1))
    temperatures = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
    seeds = torch.arange(5)
    assert torch.equal(sample_race(logits, temperatures, seeds)[:4], logits[:4].argmax(-1))


@interpreted_only
def test_interpreted_sampled_distribution_is_softmax_over_temperature():
    """Chi-square of 320 draws over 4 tokens (3 degrees of freedom): below 25 (p < 2e-5 for a
    correct sampler; fixed seeds). A sampler ignoring the temperature (T=1) or the noise scores
    in the hundreds here."""
    rows, temperature = 320, 0.6
    base = torch.tensor([1.0, 0.7, 0.2, -0.5])
    tokens = sample_race(base.expand(rows, -1), torch.full((rows,), temperature), torch.arange(rows) * 7919)
    expected = (base / temperature).softmax(-1)
    assert chi_square(tokens, expected) < 25
    assert chi_square(tokens, base.softmax(-1)) > 25


@interpreted_only
def test_interpreted_draws_follow_the_seeds():
    logits = torch.zeros(12, 100)
    temperatures = torch.ones(12)
    seeds = torch.tensor([3] * 6 + list(range(100, 106)))
    tokens = sample_race(logits, temperatures, seeds)
    assert torch.equal(tokens, sample_race(logits, temperatures, seeds))
    assert len(set(tokens[:6].tolist())) == 1  # one seed, one draw (whatever the row)
    assert len(set(tokens[6:].tolist())) >= 4  # six seeds over a flat 100-token row


@interpreted_only
def test_interpreted_fused_sampler_rows():
    """Greedy rows are the argmax; a seeded row's token follows its generator, not its batch."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 120, generator=gen).bfloat16()
    temperatures = torch.tensor([0.0, 1.0, 0.9, 0.0])
    seeded = {2: torch.Generator().manual_seed(42)}
    tokens = Sampler(fused=True)(logits, plain_params(temperatures, seeded)).tokens
    assert torch.equal(tokens[[0, 3]], logits[[0, 3]].argmax(-1))
    alone = Sampler(fused=True)(logits[2:3], plain_params(temperatures[2:3], {0: torch.Generator().manual_seed(42)}))
    assert int(alone.tokens[0]) == int(tokens[2])


@interpreted_only
def test_interpreted_seeded_row_draws_the_same_on_both_paths():
    """A seeded row samples the same token whether its batch is temperature-only (the fused
    kernel) or needs the torch stages (top-k, logprobs of another row): the race is the same."""
    logits = torch.randn(3, 90, generator=torch.Generator().manual_seed(1))
    temperatures = torch.tensor([0.8, 1.0, 0.0])
    seeded = 1

    def token(**change):
        params = plain_params(temperatures, {seeded: torch.Generator().manual_seed(5)})
        for name, value in change.items():
            setattr(params, name, value)
        return int(Sampler(fused=True)(logits, params).tokens[seeded])

    alone = token()
    assert token(top_k=torch.tensor([5, -1, -1]), top_p=torch.ones(3)) == alone
    assert token(logprob_rows=[0], num_logprobs=2) == alone


@eager_only
def test_triton_kernels_under_interpreter():
    run_interpreted_tests(__file__, min_passed=8)

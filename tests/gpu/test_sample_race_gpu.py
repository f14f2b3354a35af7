"""The fused sampling kernel on CUDA (nanovllm.ops.sample_race): against its reference on given
uniforms at Qwen3's vocabulary, the sampled distribution, and the Sampler's fused path."""
import pytest
import torch

from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.ops import sample_race, sample_race_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"
VOCAB = 151_936


def race_inputs(rows, vocab, dtype, pad):
    """As tests/test_sample_race.py's: strided logits, rows greedy / T 0.3 / T 2.5 in turn, each
    row's winner raised by 0.1 so that no near-tie lets float rounding pick another token."""
    gen = torch.Generator(DEVICE).manual_seed(rows)
    logits = (torch.randn(rows, vocab + pad, device=DEVICE, generator=gen) * 3).to(dtype)[:, :vocab]
    temperatures = torch.tensor([0.0, 0.3, 2.5], device=DEVICE).repeat(rows)[:rows]
    uniforms = torch.rand(rows, vocab, device=DEVICE, generator=gen).clamp(1e-6, 1 - 1e-6)
    winners = sample_race_ref(logits, temperatures, None, uniforms)
    logits[torch.arange(rows, device=DEVICE), winners] += 0.1
    return logits, temperatures, uniforms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, VOCAB), (64, VOCAB), (5, 4096 * 3 + 17)])
def test_kernel_matches_reference_given_uniforms(dtype, rows, vocab):
    logits, temperatures, uniforms = race_inputs(rows, vocab, dtype, pad=64)
    tokens = sample_race(logits, temperatures, None, uniforms)
    expected = sample_race_ref(logits, temperatures, None, uniforms)
    assert torch.equal(tokens, expected)
    if rows > 1:  # the inputs tell a kernel ignoring T apart
        assert (sample_race_ref(logits, (temperatures > 0).float(), None, uniforms) != expected).any()
    assert torch.equal(sample_race(logits, None, None), logits.float().argmax(-1))


def test_greedy_ties_take_the_first_index():
    logits = torch.randn(3, VOCAB, device=DEVICE).bfloat16()
    logits[0, [5, 4096, 150_000]] = 20.0
    logits[1, [8191, 8192]] = 20.0
    logits[2] = float("-inf")
    assert sample_race(logits, None, None).tolist() == [5, 8191, 0]


def test_sampled_distribution_is_softmax_over_temperature():
    """One million rows (one draw each, random seeds) over 8 tokens: every frequency within 0.003
    of softmax(logits / T) (> 6 standard deviations; fixed seeds)."""
    rows = 1_000_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], device=DEVICE)
    for temperature in (1.0, 0.6, 1.7):
        seeds = torch.randint(2**62, (rows,), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
        logits = base.bfloat16().expand(rows, -1)  # row stride 0
        tokens = sample_race(logits, torch.full((rows,), temperature, device=DEVICE), seeds)
        freq = torch.bincount(tokens, minlength=8).double() / rows
        expected = (base.bfloat16().double() / temperature).softmax(-1)
        assert (freq - expected).abs().max() < 0.003, (temperature, freq, expected)


def test_a_long_row_samples_its_softmax():
    """Many seeds over one Qwen3-sized row (4 tokens hold most of the mass, the rest is flat): the
    four's frequencies and the tail's total match softmax within 0.007 over 100,000 draws (4.5
    standard deviations; fixed seeds)."""
    rows = 100_000
    row = torch.zeros(VOCAB, device=DEVICE)
    hot = torch.tensor([3, 70_000, 100_001, VOCAB - 1], device=DEVICE)
    row[hot] = torch.tensor([12.0, 11.5, 11.0, 10.0], device=DEVICE)
    probs = row.double().softmax(-1)
    seeds = torch.arange(rows, device=DEVICE) * 1_000_003
    tokens = sample_race(row.bfloat16().expand(rows, -1), torch.ones(rows, device=DEVICE), seeds)
    freq = torch.bincount(tokens, minlength=VOCAB).double() / rows
    assert (freq[hot] - probs[hot]).abs().max() < 0.007, (freq[hot], probs[hot])
    assert abs(float(1 - freq[hot].sum()) - float(1 - probs[hot].sum())) < 0.007


def test_fused_sampler_greedy_rows_and_seeded_rows():
    logits = torch.randn(6, VOCAB, device=DEVICE).bfloat16()
    temperatures = torch.tensor([1.0, 0.6, 1.0, 1.0, 0.8, 1.0], device=DEVICE)
    params = SamplingTensors(temperatures, None, None, None, sampled_rows=[1, 2, 4],
                             generators={2: torch.Generator(DEVICE).manual_seed(7)})
    tokens = Sampler()(logits, params, torch.Generator(DEVICE).manual_seed(0)).tokens
    assert torch.equal(tokens[[0, 3, 5]], logits[[0, 3, 5]].argmax(-1))
    alone = SamplingTensors(temperatures[2:3], None, None, None, sampled_rows=[0],
                            generators={0: torch.Generator(DEVICE).manual_seed(7)})
    assert int(Sampler()(logits[2:3], alone).tokens[0]) == int(tokens[2])

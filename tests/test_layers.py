"""CPU tests of nanovllm.layers: oneDNN-packed float32 linears against F.linear, weight loading
around packing, and the LM head tied to the embedding."""

import pytest
import torch
import torch.nn.functional as F

from nanovllm.ops import cpu_gemm
from nanovllm.ops.cpu_gemm import PackedWeight
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
def test_onednn_packed_linear_is_found_where_torch_has_onednn():
    """The packed path turns itself off when torch lacks its op; with oneDNN built in it must not."""
    assert cpu_gemm._onednn_usable()


def assert_gemm_close(actual, expected):
    """float32 GEMMs that differ only in summation order."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 16, 300])
def test_packed_linear_matches_f_linear_and_releases_the_plain_weight(rows):
    weight, bias = torch.randn(96, 64), torch.randn(96)
    expected_weight = weight.clone()
    packed = PackedWeight(release_source=True)
    x = torch.randn(rows, 128)[:, ::2]  # strided rows
    with torch.inference_mode():
        out = packed.linear(x, weight, bias)
        assert_gemm_close(out, F.linear(x, expected_weight, bias))
        assert weight.untyped_storage().nbytes() == 0 and weight.shape == (96, 64)
        x3 = torch.randn(2, 5, 64)
        assert_gemm_close(packed.linear(x3, weight), F.linear(x3, expected_weight))
    packed.unpack(weight)
    assert torch.equal(weight, expected_weight) and packed.packed is None


@needs_onednn
def test_other_dtypes_and_an_unusable_onednn_take_f_linear_exactly(monkeypatch):
    weight, x = torch.randn(32, 16), torch.randn(4, 16)
    expected_weight = weight.clone()
    packed = PackedWeight(release_source=True)
    with torch.inference_mode():
        assert torch.equal(packed.linear(x.bfloat16(), weight.bfloat16()), F.linear(x.bfloat16(), weight.bfloat16()))
        assert packed.packed is None
        packed.linear(x, weight)  # packs and releases ...
        monkeypatch.setitem(cpu_gemm._state, "usable", False)
        assert torch.equal(packed.linear(x, weight), F.linear(x, expected_weight))
        assert packed.packed is None and torch.equal(weight, expected_weight)  # ... and comes back


@needs_onednn
def test_loading_a_shard_after_packing_keeps_the_other_shards():
    layer = MergedColumnParallelLinear(64, [48, 48])
    gate, up = torch.randn(48, 64), torch.randn(48, 64)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert_gemm_close(layer(x), x @ torch.cat([gate, up]).T)
    new_up = torch.randn(48, 64)
    layer.weight.weight_loader(layer.weight, new_up, 1)
    assert torch.equal(layer.weight, torch.cat([gate, new_up]))
    with torch.inference_mode():
        assert_gemm_close(layer(x), x @ torch.cat([gate, new_up]).T)


@needs_onednn
def test_qkv_and_row_parallel_layers_with_bias():
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True)
    shards = {"q": torch.randn(64, 64), "k": torch.randn(32, 64), "v": torch.randn(32, 64)}
    biases = {"q": torch.randn(64), "k": torch.randn(32), "v": torch.randn(32)}
    for name in shards:
        qkv.weight.weight_loader(qkv.weight, shards[name], name)
        qkv.bias.weight_loader(qkv.bias, biases[name], name)
    row = RowParallelLinear(128, 64, bias=True)
    row.weight.weight_loader(row.weight, torch.randn(64, 128))
    row.bias.weight_loader(row.bias, torch.randn(64))
    row_weight = row.weight.detach().clone()
    x = torch.randn(7, 64)
    with torch.inference_mode():
        h = qkv(x)
        assert_gemm_close(h, F.linear(x, torch.cat(list(shards.values())), torch.cat(list(biases.values()))))
        assert_gemm_close(row(h), F.linear(h, row_weight, row.bias))


@needs_onednn
def test_tied_lm_head_keeps_the_embedding_and_follows_its_writes():
    embed, head = VocabParallelEmbedding(100, 32), ParallelLMHead(100, 32)
    embed.weight.weight_loader(embed.weight, torch.randn(100, 32))
    head.weight = embed.weight
    x, ids = torch.randn(5, 32), torch.tensor([3, 99, 0])
    with torch.inference_mode():
        logits = head(x)
        assert logits.dtype == torch.float32
        assert_gemm_close(logits, x @ embed.weight.T)
        assert torch.equal(embed(ids), embed.weight[ids])  # the plain weight is kept
    new = torch.randn(100, 32)
    embed.weight.weight_loader(embed.weight, new)
    with torch.inference_mode():
        assert_gemm_close(head(x), x @ new.T)

"""Vocabulary-parallel embedding and LM head (each rank holds a contiguous slice of the vocab)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.ops.cpu_gemm import PackedWeight
from nanovllm.layers.linear import linear_float32_out
from nanovllm.parallel.process_group import tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Token ids ``[num_tokens]`` -> embeddings ``[num_tokens, hidden]``; ranks all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard_size = (vocab_size + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.shard_size * self.tp_rank
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        expected = (self.vocab_size, param.size(1))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected [vocab_size, hidden_size] = {list(expected)}, got {list(loaded.shape)}")
        shard = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        with torch.no_grad():  # a write the version counter sees: a packed LM head copy repacks
            param[:shard.size(0)].copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """hidden ``[num_tokens, hidden]`` -> float32 logits ``[num_tokens, vocab]`` (gathered on
    every rank).

    Logits stay float32 even for a 16-bit model: rounding them to bfloat16 (8 mantissa bits,
    a step of 1/32 at logit 5) ties or swaps the top candidates of a large vocabulary often
    enough to change greedy tokens (docs/benchmarks.md, 'Correctness on the GPU').
    A float32 CPU head multiplies through a oneDNN-packed copy of its weight, kept beside the
    plain one, which a tied embedding reads (:mod:`nanovllm.ops.cpu_gemm`).
    """

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.packed_weight = PackedWeight(release_source=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            logits = self.packed_weight.linear(x, self.weight)
        else:
            logits = linear_float32_out(x, self.weight)
        if self.tp_size > 1:
            shards = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(shards, logits)
            logits = torch.cat(shards, -1)
        return logits[..., :self.vocab_size]

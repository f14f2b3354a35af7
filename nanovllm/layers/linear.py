"""Linear layers sharded for tensor parallelism (Megatron-LM column / row parallelism).

Each parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that copies this
rank's slice of a full checkpoint tensor into it; the loader calls it. float32 CPU layers run
their GEMM through a oneDNN-packed copy of the weight (:mod:`nanovllm.ops.cpu_gemm`).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.ops.cpu_gemm import PackedWeight
from nanovllm.parallel.process_group import tp_rank, tp_size


def linear_float32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as float32, whatever the input dtype: ``x [M, K]``, ``weight [N, K]`` ->
    float32 ``[M, N]``. CUDA half inputs use cuBLAS's fp32-output GEMM (fp32 accumulation, no
    rounding of the result to 16 bits); elsewhere the operands are upcast."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(x, weight)
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        return torch.mm(x.reshape(-1, x.size(-1)), weight.t(), torch.float32).view(*x.shape[:-1], -1)
    return F.linear(x.float(), weight.float())


def _check_size(loaded: torch.Tensor, dim: int, expected: int):
    """A checkpoint tensor must have exactly the size the config implies (never sliced to fit)."""
    if loaded.size(dim) != expected:
        raise ValueError(f"expected size {expected} in dim {dim}, got shape {list(loaded.shape)}")


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b), with W split along ``tp_dim`` (0: output features, 1: input features)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self._load
        self.packed_weight = PackedWeight(release_source=True)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self._load
        else:
            self.register_parameter("bias", None)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id):
        self.packed_weight.unpack(self.weight)  # a released weight gets its values back first
        self.weight_loader(param, loaded, *shard_id)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.packed_weight.linear(x, self.weight, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if self.tp_dim is not None and self.tp_dim < loaded.dim():
            size = param.size(self.tp_dim)
            _check_size(loaded, self.tp_dim, size * self.tp_size)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, tp_size()), bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one GEMM (e.g. gate_proj and up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None):
        """Projection ``shard_id``'s full checkpoint tensor, or (``None``) all of them fused in
        one tensor in order (e.g. a checkpoint's ``gate_up_proj``): this rank's slice of each."""
        if shard_id is None:
            _check_size(loaded, 0, sum(self.output_sizes))
            for i, part in enumerate(loaded.split(self.output_sizes, 0)):
                self.weight_loader(param, part, i)
            return
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        _check_size(loaded, 0, self.output_sizes[shard_id])
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM; heads split across ranks (GQA aware)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, size)
        self.num_kv_heads = _divide(num_kv_heads, size)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None):
        """``q``, ``k`` or ``v``'s full checkpoint tensor, or (``None``) the three fused in one
        tensor ``[q; k; v]`` (e.g. a checkpoint's ``qkv_proj``): this rank's heads of each."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id is None:
            sizes = [q_size * self.tp_size, kv_size * self.tp_size, kv_size * self.tp_size]
            _check_size(loaded, 0, sum(sizes))
            for part, name in zip(loaded.split(sizes, 0), "qkv"):
                self.weight_loader(param, part, name)
            return
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        _check_size(loaded, 0, size * self.tp_size)
        shard = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(shard)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed by all-reduce.

    With more than one rank the partial products stay float32 through the all-reduce and are
    rounded to the model's dtype once, after the bias, as a single GEMM rounds its float32
    accumulator once: summing bfloat16 partials would round twice and move TP's activations a
    bfloat16 step away from TP=1's (enough to change greedy tokens at near-ties). The price is
    twice the all-reduce bytes.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, tp_size()), output_size, bias, 1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if loaded.dim() == 1:  # the bias is not split; it is added after the all-reduce
            param.data.copy_(loaded)
            return
        super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._gemm(x, self.bias)
        y = self._gemm(x, None) if x.dtype == torch.float32 else linear_float32_out(x, self.weight)
        dist.all_reduce(y)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)

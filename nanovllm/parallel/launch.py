"""How this process was launched, read from the environment once (by ``Config``) and carried.

Two launch modes:

- **spawned** (a plain ``python`` run): this process is rank 0 of replica 0 and starts the other
  tensor-parallel ranks and data-parallel replicas on this host (``ranks.py``,
  ``data_parallel.py``);
- **torchrun** (``TORCHELASTIC_RUN_ID`` is set; env:// rendezvous, so ranks may live on several
  hosts): every process runs the user's script and builds its own engine. Global rank ``g`` is
  tensor-parallel rank ``g % TP`` of replica ``g // TP``.
"""
import os
from typing import NamedTuple


class Launch(NamedTuple):
    """This process's place in the job.

    Attributes:
        torchrun: started by torchrun (else spawned, or a single process).
        rank: global rank (torchrun's ``RANK``; 0 in a spawned job's first process).
        local_rank: the CUDA device index of this process on its host.
        world_size: processes of the job (torchrun's ``WORLD_SIZE``; else
            ``data_parallel_size * tensor_parallel_size``).
        local_world_size: processes of the job on this host, which split its memory.
        replica: the data-parallel replica of this process.
        tp_rank: this process's rank within its replica's tensor-parallel group.
    """

    torchrun: bool
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    replica: int
    tp_rank: int

    @property
    def cuda_devices(self) -> range:
        """The CUDA device indices the engine of this process occupies on its host: a torchrun
        process its own (``local_rank``); a spawned job ``0 .. world_size - 1`` (replica ``r``'s
        tensor-parallel rank ``t`` on device ``r * tensor_parallel_size + t``)."""
        return range(self.local_rank, self.local_rank + 1) if self.torchrun else range(self.world_size)


def torchrun_environment() -> bool:
    """Whether torchrun started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def resolve_launch(tensor_parallel_size: int, data_parallel_size: int) -> Launch:
    """This process's :class:`Launch` for a job of ``data_parallel_size`` replicas of
    ``tensor_parallel_size`` ranks, from torchrun's variables when torchrun started it."""
    if not torchrun_environment():
        ranks = tensor_parallel_size * data_parallel_size
        return Launch(False, 0, 0, ranks, ranks, 0, 0)
    env = os.environ
    rank = int(env["RANK"])
    replica, tp_rank = divmod(rank, tensor_parallel_size)
    return Launch(True, rank, int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]),
                  replica, tp_rank)

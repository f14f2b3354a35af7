"""Rank 0 -> worker calls of a spawned tensor-parallel engine, through one shared-memory buffer.

Rank 0 pickles ``(method, args)`` into the buffer and sets one event per worker; each worker waits
on its event, then calls the same method on its own runner, so all ranks run each forward
together. The buffer's name is chosen per engine, so two engines on one host never collide.
"""
import os
import pickle
import uuid
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import torch.distributed as dist

SHM_SIZE = 1 << 22
"""Bytes of the buffer: the largest pickled call."""


def new_shm_name() -> str:
    """A shared-memory name unique to this engine."""
    return f"nanovllm_{os.getpid()}_{uuid.uuid4().hex[:12]}"


class RankChannel:
    """Rank 0 writes calls, workers read them, through one shared-memory buffer."""

    def __init__(self, name: str, rank: int, events: list[Event] | Event):
        self.rank, self.events = rank, events
        if rank == 0:
            self.shm = SharedMemory(name=name, create=True, size=SHM_SIZE)
            dist.barrier()
        else:
            dist.barrier()
            self.shm = SharedMemory(name=name)

    def send(self, method: str, *args):
        data = pickle.dumps((method, args))
        if len(data) + 4 > SHM_SIZE:
            raise RuntimeError(f"call {method} is {len(data)} bytes, over the {SHM_SIZE}-byte channel")
        self.shm.buf[0:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:len(data) + 4] = data
        for event in self.events:
            event.set()

    def receive(self) -> tuple[str, tuple]:
        self.events.wait()
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method, args = pickle.loads(self.shm.buf[4:n + 4])
        self.events.clear()
        return method, args

    def close(self):
        self.shm.close()
        if self.rank == 0:
            self.shm.unlink()

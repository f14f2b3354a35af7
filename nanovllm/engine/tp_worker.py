"""Tensor-parallel plumbing: process-group setup and rank 0 -> worker method calls.

Two launch modes:

- Spawned workers (a plain ``python`` run): rank 0 is the user's process and starts ranks
  1..N-1 on this host. Rank 0 pickles ``(method, args)`` into a shared-memory buffer and sets
  one event per worker; each worker loops, waiting on its event, then calls the same method on
  its own ModelRunner, so all ranks run each forward together. Rank 0 waits for the workers
  to join its TCP store, watching that they are alive. Port and shared-memory name are chosen
  per engine, so two engines on one host never collide.
- torchrun (env:// rendezvous, so ranks may live on several hosts): every rank runs the user's
  script, builds the same engine and schedules the same steps; rank 0 samples and broadcasts
  the tokens, so every rank's scheduler sees the same sequences (vLLM's "external launcher").
  With data parallelism (``engine.data_parallel``) torchrun starts D x TP processes and each
  process's default group is its replica's tensor-parallel group: global ranks
  ``r * TP .. r * TP + TP - 1`` form replica r's, rendezvousing under their own prefix of
  torchrun's store.
"""
import atexit
import functools
import os
import pickle
import time
import uuid
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event
from typing import NamedTuple

import torch
import torch.distributed as dist
import xxhash

SHM_SIZE = 1 << 22
JOIN_POLL_S = 0.05


def new_shm_name() -> str:
    return f"nanovllm_{os.getpid()}_{uuid.uuid4().hex[:12]}"


class TorchrunRank(NamedTuple):
    rank: int
    local_rank: int  # the CUDA device index on this host
    world_size: int
    local_world_size: int  # ranks on this host (they share its memory)


def torchrun_rank() -> TorchrunRank | None:
    """This process's place when torchrun started it (``TORCHELASTIC_RUN_ID`` is set), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    env = os.environ
    return TorchrunRank(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
                        int(env["LOCAL_WORLD_SIZE"]))


def rendezvous_store(world_size: int) -> dist.TCPStore:
    """Rank 0's TCP store for a spawned engine, on a port the OS picks (``store.port``; the
    workers get it as an argument), so two engines on one host never collide."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def wait_for_workers(store: dist.TCPStore, workers: list) -> None:
    """Return once every spawned worker has called :func:`join`.

    Raises:
        RuntimeError: a worker exited first, naming its rank and exit code (e.g. a script that
            builds the LLM without ``if __name__ == "__main__":``, which spawned processes need).
    """
    keys = [f"joined_{rank}" for rank in range(1, len(workers) + 1)]
    while not store.check(keys):
        for rank, proc in enumerate(workers, 1):
            if not proc.is_alive():
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited with code {proc.exitcode} before joining; spawned "
                    f"ranks re-import the main script, so build the LLM under if __name__ == '__main__':")
        time.sleep(JOIN_POLL_S)


def join(port: int, rank: int, world_size: int) -> dist.TCPStore:
    """A spawned worker's side of the rendezvous: connect to rank 0's store and say so."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    store.set(f"joined_{rank}", "1")
    return store


@functools.cache
def torchrun_store() -> dist.Store:
    """This torchrun process's client of the job's TCP store (env:// rendezvous: ``MASTER_ADDR``,
    ``MASTER_PORT``), made once."""
    store, _, _ = next(dist.rendezvous("env://"))
    return store


def init_process_group(device: str, rank: int, world_size: int, store: dist.TCPStore | None):
    """NCCL on CUDA, gloo on CPU, over a spawned engine's ``store``. Under torchrun, once per
    process (the group outlives engines: torchrun's store keeps the first group's keys, so a
    second rendezvous under the same name could read stale addresses): env:// rendezvous when
    the group is every process; else (data parallelism) the group of ``world_size`` consecutive
    global ranks holding this one, rendezvousing under its own prefix of torchrun's store.

    Raises:
        RuntimeError: this torchrun process already has a group of another backend or size
            (engines in one torchrun process share one layout).
    """
    backend = "nccl" if device == "cuda" else "gloo"
    launch = torchrun_rank()
    if launch is None:
        dist.init_process_group(backend, store=store, world_size=world_size, rank=rank)
        return
    if dist.is_initialized():
        if (dist.get_backend(), dist.get_world_size()) != (backend, world_size):
            raise RuntimeError(f"this torchrun process already has a {dist.get_backend()} process group of "
                               f"{dist.get_world_size()} ranks; an engine on {device} with tensor_parallel_size="
                               f"{world_size} needs {backend} over {world_size} (one layout per process)")
        return
    if launch.world_size == world_size:
        dist.init_process_group(backend, init_method="env://")
    else:
        replica = launch.rank // world_size
        dist.init_process_group(backend, store=dist.PrefixStore(f"nanovllm_tp{replica}", torchrun_store()),
                                rank=launch.rank % world_size, world_size=world_size)
    atexit.register(_destroy_torchrun_group)


def check_same_calls(payload: bytes, device) -> None:
    """Under torchrun every rank runs its own engine and must make the same calls with the same
    arguments; compare a 63-bit xxhash of ``payload`` (the call's arguments) across ranks with
    one all-reduce.

    Raises:
        RuntimeError: the ranks' payloads differ (on every rank, so none is left waiting).
    """
    digest = xxhash.xxh64_intdigest(payload) >> 1
    bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)  # [max digest, -min digest]
    if bounds[0].item() != -bounds[1].item():
        raise RuntimeError("under torchrun every rank must make the same calls with the same prompts "
                           "and sampling params, but this call's arguments differ between ranks")


def _destroy_torchrun_group():
    """At interpreter exit, tear down the torchrun process group an engine created (unless the
    script already did): left alive, gloo's threads are destroyed still running when the
    interpreter exits, which aborts the process (SIGABRT, "terminate called without an active
    exception") and fails the torchrun job."""
    if dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_group():
    """Tear down a spawned engine's process group (torchrun's stays for the process's life)."""
    if dist.is_initialized() and torchrun_rank() is None:
        dist.destroy_process_group()


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

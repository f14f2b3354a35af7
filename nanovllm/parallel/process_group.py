"""The tensor-parallel process group: setup and teardown in both launch modes (``launch.py``),
this rank's place in it, and the check that torchrun's ranks make the same calls.

Spawned ranks join rank 0's TCP store (``ranks.py``); under torchrun the group is made once per
process over torchrun's store, and with data parallelism each replica's ranks form their own
group under a prefix of that store.
"""
import atexit
import functools

import torch
import torch.distributed as dist
import xxhash

from nanovllm.parallel.launch import Launch


def tp_rank() -> int:
    """This rank within the tensor-parallel group (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    """Ranks of the tensor-parallel group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


@functools.cache
def torchrun_store() -> dist.Store:
    """This torchrun process's client of the job's TCP store (env:// rendezvous: ``MASTER_ADDR``,
    ``MASTER_PORT``), made once."""
    store, _, _ = next(dist.rendezvous("env://"))
    return store


def init_process_group(device: str, rank: int, world_size: int, store: dist.TCPStore | None, launch: Launch):
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
    if not launch.torchrun:
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
        dist.init_process_group(backend, store=dist.PrefixStore(f"nanovllm_tp{launch.replica}", torchrun_store()),
                                rank=launch.tp_rank, world_size=world_size)
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


def destroy_process_group(launch: Launch):
    """Tear down a spawned engine's process group (torchrun's stays for the process's life)."""
    if dist.is_initialized() and not launch.torchrun:
        dist.destroy_process_group()

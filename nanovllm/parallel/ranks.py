"""The tensor-parallel ranks of a spawned engine: ranks 1..N-1 started as processes on this host,
watched for death, and stopped with rank 0's runner. A spawned rank exits when the process that
started it is gone (killed before it could stop its ranks, e.g. a data-parallel replica), instead
of waiting for its next call forever."""
import os
import threading
import time
from multiprocessing import get_context

import torch.distributed as dist

from nanovllm.parallel.channel import new_shm_name

JOIN_POLL_S = 0.05
"""How often rank 0 checks whether the spawned ranks have joined its store."""


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


def spawn_ranks(runner_class, config, first_device: int, workers: list):
    """Start ranks 1..N-1 of ``config.tensor_parallel_size`` as processes on this host (appended to
    ``workers`` as they start), each building ``runner_class(config, rank, channel, event, port,
    device)``, which serves rank 0's calls until "exit"; return rank 0's runner. Rank k uses CUDA
    device ``first_device + k``. A failure stops the started ranks before it is raised."""
    channel, events, store = None, [], None
    if config.tensor_parallel_size > 1:
        channel, store = new_shm_name(), rendezvous_store(config.tensor_parallel_size)
        ctx = get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            event = ctx.Event()
            proc = ctx.Process(target=_rank_main,
                               args=(runner_class, os.getpid(), config, rank, channel, event, store.port,
                                     first_device + rank))
            proc.start()
            workers.append(proc)
            events.append(event)
    try:
        if store is not None:
            wait_for_workers(store, workers)
        return runner_class(config, 0, channel, events, local_rank=first_device, store=store)
    except BaseException:
        for proc in workers:
            proc.terminate()
            proc.join()
        raise


PARENT_POLL_S = 0.5
"""How often a spawned rank checks that the process that started it is alive."""


def _rank_main(runner_class, parent: int, config, rank: int, channel: str, event, port: int, device: int):
    """A spawned rank's process: its runner's call loop, ended by rank 0's "exit" or, through
    :func:`_exit_with_parent`, by rank 0's process being gone."""
    _exit_with_parent(parent)
    runner_class(config, rank, channel, event, port, device)


def _exit_with_parent(parent: int) -> None:
    """End this process (``os._exit``: its runner may be blocked in a wait) once its parent
    ``parent`` is gone: a daemon thread polls ``os.getppid()``, which changes when the parent
    dies and this process is re-parented."""
    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="nanovllm-parent-watch", daemon=True).start()


def check_workers(workers: list):
    """A spawned rank that died would leave the others waiting in a collective forever."""
    for rank, proc in enumerate(workers, 1):
        if not proc.is_alive():
            raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                               f"{proc.exitcode}; shut this engine down and create a new LLM")


def shutdown(model_runner, workers: list, replicas):
    """Stop the data-parallel replicas (if any), then this replica's ranks and runner."""
    if replicas is not None:
        replicas.close()
    if all(proc.is_alive() for proc in workers):
        model_runner.call("exit")
    else:  # a dead worker's event would block the send: stop the others instead
        for proc in workers:
            proc.terminate()
        model_runner.exit()
    for proc in workers:
        proc.join()

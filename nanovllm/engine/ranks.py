"""The tensor-parallel ranks of a spawned engine: ranks 1..N-1 started as processes on this host,
watched for death, and stopped with rank 0's runner."""
from multiprocessing import get_context

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.tp_worker import new_shm_name, rendezvous_store, wait_for_workers


def spawn_ranks(config: Config, first_device: int, workers: list) -> ModelRunner:
    """Start ranks 1..N-1 as processes on this host (appended to ``workers`` as they start);
    return rank 0's runner. Rank k uses CUDA device ``first_device + k``. A failure stops the
    started ranks before it is raised."""
    channel, events, store = None, [], None
    if config.tensor_parallel_size > 1:
        channel, store = new_shm_name(), rendezvous_store(config.tensor_parallel_size)
        ctx = get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            event = ctx.Event()
            proc = ctx.Process(target=ModelRunner,
                               args=(config, rank, channel, event, store.port, first_device + rank))
            proc.start()
            workers.append(proc)
            events.append(event)
    try:
        if store is not None:
            wait_for_workers(store, workers)
        return ModelRunner(config, 0, channel, events, local_rank=first_device, store=store)
    except BaseException:
        for proc in workers:
            proc.terminate()
            proc.join()
        raise


def check_workers(workers: list):
    """A spawned rank that died would leave the others waiting in a collective forever."""
    for rank, proc in enumerate(workers, 1):
        if not proc.is_alive():
            raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                               f"{proc.exitcode}; shut this engine down and create a new LLM")


def shutdown(model_runner: ModelRunner, workers: list, replicas):
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

"""Data parallelism for offline batches: ``data_parallel_size`` (D) replicas of the engine, each
with ``tensor_parallel_size`` (TP) ranks, share every ``generate`` call.

The requests are split across the replicas balanced by token count (:func:`split_by_cost`), each
replica runs its share with its own scheduler and KV cache, and the outputs are put back in input
order (:func:`in_input_order`). Two launches, like tensor parallelism (``ranks.py``, ``process_group.py``):

- Spawned (a plain ``python`` run): the user's process is replica 0 and starts replicas 1..D-1
  as processes on this host (:class:`ReplicaPool`); replica r builds its own engine (spawning its
  own tensor-parallel ranks) on CUDA devices ``r * TP .. r * TP + TP - 1``. Calls and results
  travel through one pipe per replica, and every wait also watches the replica's process, so a
  dead replica is a ``RuntimeError`` naming it, never a hang.
- torchrun (env:// rendezvous, D x TP processes, possibly on several hosts): global rank
  ``g = r * TP + t`` is tensor-parallel rank ``t`` of replica ``r``, so a replica is TP consecutive
  ranks (with ``--nproc-per-node TP``, one replica per host). Each process's default process group
  is its replica's tensor-parallel group (``process_group.init_process_group``); a gloo group over all
  D x TP ranks (:class:`ReplicaExchange`) checks that the ranks make the same calls and all-gathers
  the replicas' results (:class:`TorchrunReplicas`), so every rank returns every output.
"""
import atexit
import copy
import functools
import heapq
import pickle
import traceback
from datetime import timedelta
from itertools import count
from multiprocessing import get_context
from multiprocessing.connection import wait
from typing import Callable

import torch
import torch.distributed as dist
import xxhash

from nanovllm.parallel.launch import Launch
from nanovllm.parallel.process_group import torchrun_store
from nanovllm.sampling_params import SamplingParams

EXCHANGE_TIMEOUT = timedelta(hours=24)
"""How long a torchrun rank waits for the other replicas in one all-gather (a fast replica waits
for the slowest to finish its share); a rank that exits is seen at once (its connections close)."""

CLOSE_TIMEOUT_S = 60
"""How long a spawned replica may take to shut its engine down before it is terminated."""

SEED_MODULUS = 2 ** 64
_request_ids = count()


# ---- splitting ---------------------------------------------------------------------------

def request_cost(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    """Tokens a request costs: ``n`` x (prompt tokens + ``max_tokens``), ``max_tokens`` capped at
    what ``max_model_len`` leaves (None: all of it)."""
    room = max_model_len - num_prompt_tokens
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    return params.n * (num_prompt_tokens + max_tokens)


def split_by_cost(costs: list[int], num_replicas: int) -> list[list[int]]:
    """Requests of ``costs`` over ``num_replicas`` replicas, longest processing time first (Graham
    1969: the largest replica load is at most 4/3 of the best split's): by decreasing cost (ties:
    input order), each request goes to the replica with the least cost so far (ties: the lowest
    index). Returns each replica's request indices, in input order; deterministic, so every
    torchrun rank computes the same split."""
    loads = [(0, replica) for replica in range(num_replicas)]
    shares = [[] for _ in range(num_replicas)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, replica = heapq.heappop(loads)
        shares[replica].append(i)
        heapq.heappush(loads, (load + costs[i], replica))
    return [sorted(share) for share in shares]


def in_input_order(shares: list[list[int]], results: list[list]) -> list:
    """The replicas' ``results`` (one per index of their share) as one list in input order."""
    merged = [None] * sum(map(len, shares))
    for share, replica_results in zip(shares, results, strict=True):
        for i, result in zip(share, replica_results, strict=True):
            merged[i] = result
    return merged


def number_requests(outputs: list) -> list:
    """Give the merged outputs request ids "dp0", "dp1", ... in input order, from one counter per
    process (a replica's own ids, its sequence ids, repeat across processes). Every torchrun rank
    makes the same calls, so every rank gives the same ids."""
    for out in outputs:
        out.request_id = f"dp{next(_request_ids)}"
    return outputs


def replica_config(config, replica: int):
    """Replica ``replica``'s config: the engine's, with the sampling generator seeded
    ``(seed + replica) mod 2**64`` (replica 0 keeps ``seed``), so requests without a seed draw
    different numbers on different replicas. Seeded requests use their own generators."""
    if replica == 0:
        return config
    config = copy.copy(config)
    config.seed = (config.seed + replica) % SEED_MODULUS
    return config


# ---- statistics --------------------------------------------------------------------------

def sum_kv_cache_stats(per_replica: list[dict]) -> dict:
    """``LLM.get_kv_cache_stats()`` of the whole engine: every count summed over the replicas (a
    str, the ``kv_cache_dtype`` all replicas share, taken from the first)."""
    first = per_replica[0]
    return {key: value if isinstance(value, str) else sum(stats[key] for stats in per_replica)
            for key, value in first.items()}


# ---- spawned replicas --------------------------------------------------------------------

class ReplicaPool:
    """Replicas 1..D-1 of an engine in a plain ``python`` run: one spawned process each, running
    ``target(conn, config, replica)``, which builds the replica's engine and calls :func:`serve`
    (or :func:`report_start_failure`). Each call carries a number that its answer repeats, so an
    answer to a call abandoned half-way (an exception or KeyboardInterrupt here while the
    replicas were still busy) is skipped by the next call rather than taken for its own.

    Raises (any method): RuntimeError naming the replica when it died or its call failed.
    """

    def __init__(self, config, target: Callable):
        ctx = get_context("spawn")
        self.procs, self.conns, self.failed, self.call_id = [], [], None, 0
        try:
            for replica in range(1, config.data_parallel_size):
                conn, child_conn = ctx.Pipe()
                proc = ctx.Process(target=target, args=(child_conn, config, replica),
                                   name=f"nanovllm-replica-{replica}")
                proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(conn)
        except BaseException:
            self.close()
            raise

    def join(self, local_capacity: int) -> list[int]:
        """Wait until every replica has built its engine; each replica's KV capacity in tokens
        (replica 0's is ``local_capacity``)."""
        return [local_capacity] + self._receive_all("starting")

    def run(self, shares: list[tuple], run_local: Callable) -> list:
        """``shares[r]`` (the arguments of the engine's "generate" call) to replica r; replica 0's
        share runs here, ``run_local(share)``, while the others run theirs. Returns each
        replica's result."""
        self._send("generate", shares[1:])  # a share: generate's arguments
        local = run_local(shares[0])
        return [local] + self._receive_all("generate")

    def call(self, method: str, local_value) -> list:
        """``method()`` of every other replica's engine; ``[local_value, their results...]``."""
        self._send(method, [()] * len(self.conns))
        return [local_value] + self._receive_all(method)

    def _send(self, method: str, args: list[tuple]):
        self._check_usable()
        self.call_id += 1
        for conn, replica_args in zip(self.conns, args):
            conn.send((self.call_id, method, replica_args))

    def _check_usable(self):
        if self.failed is not None:
            raise RuntimeError(f"{self.failed}; shut this engine down and create a new LLM")
        for replica, proc in enumerate(self.procs, 1):
            if not proc.is_alive():
                self._fail(f"data-parallel replica {replica} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _fail(self, message: str):
        self.failed = message
        raise RuntimeError(f"{message}; shut this engine down and create a new LLM")

    def _receive_all(self, doing: str) -> list:
        """Every replica's answer to the current call, in replica order (all are read before the
        first error is raised)."""
        answers, errors = [], []
        for replica, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            try:
                answers.append(self._receive(replica, conn, proc, doing))
            except RuntimeError as err:
                errors.append(err)
        if errors:
            raise errors[0]
        return answers

    def _receive(self, replica: int, conn, proc, doing: str):
        call_id = -1
        while call_id != self.call_id:  # skip answers to abandoned calls
            wait([conn, proc.sentinel])
            try:
                call_id, status, value = conn.recv()
            except (EOFError, OSError):  # the process died (nothing or half a message in the pipe)
                proc.join()
                hint = (" before it was ready; spawned replicas re-import the main script, so build the LLM "
                        "under if __name__ == '__main__':") if doing == "starting" else f" while {doing}"
                self._fail(f"data-parallel replica {replica} (pid {proc.pid}) exited with code "
                           f"{proc.exitcode}{hint}")
        if status == "error":
            if doing == "starting":
                self.failed = f"data-parallel replica {replica} failed to start"
            raise RuntimeError(f"data-parallel replica {replica} failed while {doing}:\n{value}")
        return value

    def close(self):
        """Ask every live replica to shut its engine down and exit; stop those that do not."""
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send((self.call_id + 1, "exit", ()))
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=CLOSE_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def serve(conn, kv_capacity: int, calls: dict[str, Callable]) -> None:
    """A spawned replica's loop, once its engine is built: report its ``kv_capacity`` (tokens),
    then run each ``(call id, method, args)`` it is sent from ``calls``, answering ``(call id,
    "ok", result)`` or ``(call id, "error", traceback)``, until "exit" or until the user's
    process is gone (its end of the pipe closed)."""
    conn.send((0, "ok", kv_capacity))
    while True:
        try:
            call_id, method, args = conn.recv()
        except EOFError:
            return
        if method == "exit":
            return
        try:
            reply = (call_id, "ok", calls[method](*args))
        except Exception:
            reply = (call_id, "error", traceback.format_exc())
        conn.send(reply)


def report_start_failure(conn) -> None:
    """A spawned replica whose engine failed to build says why (the current exception)."""
    conn.send((0, "error", traceback.format_exc()))


# ---- torchrun ----------------------------------------------------------------------------

class ReplicaExchange:
    """A gloo group over every torchrun rank, besides the default process group (which is this
    rank's tensor-parallel group): all-gathers of picklable objects. Created once per process
    (:func:`torchrun_exchange`): torchrun's store keeps a group's keys for the job's life."""

    def __init__(self, rank: int, world_size: int):
        self.world_size = world_size
        store = dist.PrefixStore("nanovllm_dp", torchrun_store())
        self.group = dist.ProcessGroupGloo(store, rank, world_size, EXCHANGE_TIMEOUT)

    def all_gather(self, obj) -> list:
        """``obj`` of every rank, in rank order (two gloo all-gathers: sizes, then the pickles)."""
        data = pickle.dumps(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.group.allgather([sizes], [torch.tensor([len(data)])]).wait()
        width = max(int(size) for size in sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        self.group.allgather([gathered], [mine]).wait()
        return [pickle.loads(t[:int(size)].numpy().tobytes()) for t, size in zip(gathered, sizes)]

    def close(self):
        """Release the gloo group, so that it is destroyed (its threads joined) now; the exchange
        cannot be used after."""
        self.group = None


@functools.cache
def torchrun_exchange(rank: int, world_size: int) -> ReplicaExchange:
    """The process's one exchange, released at interpreter exit (``atexit``, while the interpreter
    is intact). A gloo group still alive after the interpreter's teardown is destroyed with its
    threads still running, which aborts the process ("terminate called without an active
    exception") and fails the torchrun job; ``process_group`` does the same for the default group."""
    exchange = ReplicaExchange(rank, world_size)
    atexit.register(exchange.close)
    return exchange


class TorchrunReplicas:
    """This torchrun rank's view of the replicas: it is tensor-parallel rank ``tp_rank`` of
    replica ``replica`` (global rank = replica x TP + tp_rank). Every rank runs every method
    (they are collective, like ``generate``); each replica's tensor-parallel rank 0 contributes
    its replica's results, which its other ranks hold too.

    Raises (any method): RuntimeError when the ranks made different calls, or a replica failed
    (naming it; the failing replica's own ranks raise their own error).
    """

    def __init__(self, config, launch: Launch):
        self.tp_size = config.tensor_parallel_size
        self.replica, self.tp_rank = launch.replica, launch.tp_rank
        self.exchange = torchrun_exchange(launch.rank, launch.world_size)

    def check_same_calls(self, payload: bytes) -> None:
        """Compare an xxhash of ``payload`` (a call's arguments) across every rank."""
        digests = self.exchange.all_gather(("check_same_calls", xxhash.xxh64_intdigest(payload)))
        if len(set(digests)) > 1:
            raise RuntimeError("under torchrun every rank must make the same calls with the same prompts "
                               "and sampling params, but this call's arguments differ between ranks")

    def join(self, local_capacity: int) -> list[int]:
        """Every replica's KV capacity in tokens."""
        return self._gather("starting", ("ok", local_capacity))

    def run(self, shares: list, run_local: Callable) -> list:
        """This replica runs ``run_local(shares[replica])``; returns every replica's result."""
        try:
            local = run_local(shares[self.replica])
        except BaseException as err:
            self._gather("generate", ("error", f"{type(err).__name__}: {err}"), raise_errors=False)
            raise
        return self._gather("generate", ("ok", local))

    def call(self, method: str, local_value) -> list:
        """Every replica's ``local_value`` (this rank's result of ``method``)."""
        return self._gather(method, ("ok", local_value))

    def close(self):
        """Nothing to release: the exchange lives as long as the process."""

    def _gather(self, doing: str, reply: tuple, raise_errors: bool = True) -> list:
        mine = (doing, reply if self.tp_rank == 0 else None)
        gathered = self.exchange.all_gather(mine)
        if any(kind != doing for kind, _ in gathered):
            raise RuntimeError(f"under torchrun every rank must make the same calls, but while this rank was "
                               f"{doing}, others were {sorted({kind for kind, _ in gathered} - {doing})}")
        results = []
        for replica, (_, (status, value)) in enumerate(gathered[::self.tp_size]):
            if status == "error" and raise_errors and replica != self.replica:
                raise RuntimeError(f"data-parallel replica {replica} failed while {doing}: {value}")
            results.append(value)
        return results


def torchrun_replicas(config, launch: Launch) -> TorchrunReplicas | None:
    """The replicas of a torchrun engine, or None without data parallelism."""
    return TorchrunReplicas(config, launch) if config.data_parallel_size > 1 else None

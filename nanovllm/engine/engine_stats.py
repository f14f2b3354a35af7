"""The engine's statistics and cache controls (vLLM's ``reset_prefix_cache``), a mixin of
:class:`nanovllm.engine.llm_engine.LLMEngine`: every method works on this process's replica and,
with data parallelism, on every replica."""
from nanovllm.parallel import data_parallel
from nanovllm.sparse.stats import sum_sparse_stats


class EngineStats:
    """Statistics of the KV cache and the sparse policy; :meth:`reset_prefix_cache`. Mixed into
    ``LLMEngine``, whose ``scheduler``, ``model_runner``, ``config`` and ``_replicas`` it reads."""

    def get_kv_cache_stats(self) -> dict:
        """The KV cache's tiers as plain ints (``kv_cache_dtype`` a str)::

            {"gpu_blocks", "gpu_blocks_used", "host_blocks", "host_blocks_used", "spilled_blocks",
             "evicted_blocks", "released_blocks", "loaded_blocks", "host_bytes_pinned", "prefix_cache_hit_tokens",
             "preemptions", "kv_cache_dtype", "saturated_values", "gpu_tokens", "host_tokens", "ring_slots"}

        ``*_used``: blocks held by live sequences (free blocks holding a cached prefix are not).
        Since the engine started: ``spilled_blocks`` live blocks moved to the host tier,
        ``evicted_blocks`` freed prefix-cache blocks written back to it when their GPU block was
        reused, ``released_blocks`` blocks running sequences released before their sliding windows,
        ``loaded_blocks`` host-to-GPU reads in blocks of every layer (keys and values),
        ``prefix_cache_hit_tokens`` prompt tokens found in the prefix cache (either tier),
        ``preemptions`` sequences preempted because both tiers were full. ``host_bytes_pinned``:
        host memory page-locked now (it grows toward the host tier's capacity as blocks are used).
        ``kv_cache_dtype``: the option (``"auto"``, ``"fp8"``, ...); ``saturated_values``: key and
        value elements clamped to the fp8 range when stored (only a checkpoint's static scales
        clamp: 0 with the dynamic per-(token, KV head) scales); ``gpu_tokens``, ``host_tokens``: the
        tokens each tier holds (fp8 holds about twice the model dtype's in the same memory);
        ``ring_slots``: the host tier's ring-buffer slots (``num_ring_slots``, or the number its
        default None sizes; 0 without the host tier).
        Blocks are ``kvcache_block_size`` tokens. With ``tensor_parallel_size > 1``,
        ``loaded_blocks`` and ``host_bytes_pinned`` are rank 0's; with ``data_parallel_size > 1``
        every value is summed over the replicas (under torchrun every rank must call this).
        """
        self._check_open()
        stats = {**self.scheduler.block_manager.usage(), **self.model_runner.cache.usage(),
                 "preemptions": self.scheduler.num_preemptions}
        if self._replicas is None:
            return stats
        return data_parallel.sum_kv_cache_stats(self._replicas.call("get_kv_cache_stats", stats))

    def get_sparse_stats(self) -> dict:
        """Densities of the sparse policy since the engine started or the last
        :meth:`reset_sparse_stats`, as plain Python numbers::

            {"policy": "QUEST",
             "prefill": {"density", "comm_density", "kept_blocks", "visible_blocks",
                         "loaded_host_bytes", "available_host_bytes",
                         "per_layer": [{"layer", "density", "comm_density"}, ...]},
             "decode": {"density", "read_tokens", "context_tokens", "comm_density",
                        "loaded_host_bytes", "available_host_bytes", "reuse_rate", "reused_host_pages",
                        "read_host_pages", "per_layer": [{"layer", "density", "comm_density", "reuse_rate"}, ...]}}

        Prefill ``density``: kept / causally visible sparse blocks (``sparse_block_size`` tokens)
        over heads and query blocks; 1.0 for policies whose prefill is dense.
        Decode ``density``: tokens read per KV head / tokens of the contexts (both tiers; the
        always-read sinks, recent pages and page being written included), per layer and
        sequence, counted for a policy that chooses decode pages or a model with sliding windows
        (``read_tokens`` / ``context_tokens``); 1.0 for the others.
        ``comm_density``: bytes read from the host tier (keys and values) / bytes of the host-tier
        blocks the attention could read, per layer (None where the batch had no host blocks).
        ``reuse_rate``: host (page, KV head) reads found in the reuse cache / host (page, KV head)
        reads of a choosing policy's decode.
        Reading syncs with the device once per layer; counting never does. With
        ``tensor_parallel_size > 1`` these are rank 0's counts (its share of the heads).
        With ``data_parallel_size > 1`` (under torchrun every rank must call this): each phase's
        block counts are summed over the replicas and its ``density`` and ``comm_density``
        computed from the sums, without ``per_layer``; ``"replicas"`` lists every replica's own
        dict as above, ``per_layer`` included.
        """
        self._check_open()
        cache = self.model_runner.cache
        counts = cache.sparse_stats().to_dict(cache.policy.dense_prefill, not cache.counts_decode_reads)
        stats = {"policy": self.config.sparse_policy, **counts}
        if self._replicas is None:
            return stats
        return sum_sparse_stats(self._replicas.call("get_sparse_stats", stats))

    def reset_sparse_stats(self) -> None:
        """Zero the counts behind :meth:`get_sparse_stats` (on every replica; under torchrun
        with ``data_parallel_size > 1`` every rank must call this)."""
        self._check_open()
        self.model_runner.cache.sparse_stats().reset()
        if self._replicas is not None:
            self._replicas.call("reset_sparse_stats", None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix that no live sequence holds (vLLM's ``LLM.reset_prefix_cache``),
        in both tiers and on every replica, so later prompts are computed afresh. Returns True when
        nothing is cached any more (always so when the engine is idle), False when requests queued
        with ``add_request`` still hold cached blocks (those stay; under torchrun with
        ``data_parallel_size > 1`` every rank must call this)."""
        self._check_open()
        done = self.scheduler.block_manager.reset_prefix_cache()
        if self._replicas is None:
            return done
        return all(self._replicas.call("reset_prefix_cache", done))

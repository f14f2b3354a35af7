"""The host tier of the KV cache: pinned host blocks, the GPU ring buffer that decode reads them
through, and every host->GPU read with its streams and events. A choosing policy's host pages are
not copied but gathered per (page, KV head) (:meth:`HostTier.gather_pages`): a kernel on the
compute stream, after the step's spills, reads the pinned pages in place
(:func:`nanovllm.ops.gather_host_pages`); their bytes are counted on the device.

Memory (per rank, ``L`` layers, ``Nh`` host blocks, ``N`` ring slots):

    host  k_host, v_host  [L, Nh, block_size, Hkv, D]   pinned, layer-major
    GPU   k_slots, v_slots [N, block_size, Hkv, D]      the ring (one layer of one block per slot)

Streams and events (CUDA; on CPU every copy is synchronous and events are no-ops):

    compute (the model's current stream): record step_start -> wait spill_done -> forward ...
                                          wait slot_ready[s] -> attend slot s -> record slot_free[s]
    spill stream:     wait step_start -> D2H of each spilled block, all layers per copy
                      (cudaMemcpy2DAsync, strided by layer on both sides) -> record spill_done
    transfer stream s (one per slot): wait slot_free[s], spill_done -> H2D of one layer of one
                      block into slot s -> record slot_ready[s] (a serial plan puts every load
                      on stream 0, in order)

Gathers for prefill (:meth:`HostTier.read_block`) copy on the compute stream itself, after it
waited for the step's spills.
"""
import contextlib

import torch

from nanovllm.kvcache.memcpy2d import memcpy_2d_async
from nanovllm.ops import gather_host_pages


class _NullStream:
    """Stands in for a CUDA stream on CPU: work is already ordered."""

    def wait_event(self, event):
        pass


class _NullEvent:
    def record(self, stream=None):
        pass


class HostTier:
    """Args: num_layers, block_size, num_kv_heads, head_dim, dtype, device (the KV geometry of
    this rank); num_blocks (host blocks, >= 0); num_slots (ring slots, >= 2).

    Raises:
        RuntimeError: host memory cannot be allocated or pinned (with the byte counts).
    """

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, num_slots: int):
        self.num_layers, self.block_size, self.num_blocks, self.num_slots = num_layers, block_size, num_blocks, num_slots
        self.device, self.cuda = device, device.type == "cuda"
        block_shape = (block_size, num_kv_heads, head_dim)
        self.k_host, self.v_host = (self._host_cache((num_layers, num_blocks, *block_shape), dtype) for _ in range(2))
        # Uninitialised on purpose: a slot is written before it is read, valid lengths bound reads.
        self.k_slots, self.v_slots = (torch.empty(num_slots, *block_shape, dtype=dtype, device=device)
                                      for _ in range(2))
        self.block_bytes = block_size * num_kv_heads * head_dim * dtype.itemsize
        """Bytes of one layer of one block, keys or values."""
        self.bytes_h2d = self.bytes_d2h = 0  # copies issued by the host
        self._gathered_bytes = 0  # pages gathered by kernels: a device count
        self._make_streams()

    def _host_cache(self, shape, dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        except RuntimeError as err:
            raise RuntimeError(f"cannot allocate {'pinned ' if self.cuda else ''}host KV cache of "
                               f"{nbytes / 2**30:.2f} GiB {tuple(shape)}: {err}") from err

    def _make_streams(self):
        if self.cuda:
            new_event = torch.cuda.Event
            self.transfer_streams = [torch.cuda.Stream(self.device) for _ in range(self.num_slots)]
            self.spill_stream = torch.cuda.Stream(self.device)
        else:
            new_event = _NullEvent
            self.transfer_streams = [_NullStream() for _ in range(self.num_slots)]
            self.spill_stream = _NullStream()
        self.slot_ready = [new_event() for _ in range(self.num_slots)]
        self.slot_free = [new_event() for _ in range(self.num_slots)]
        self.step_start, self.spill_done = new_event(), new_event()

    def _stream_ctx(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def _compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else _NullStream()

    # ---- spills ------------------------------------------------------------------------
    def spill(self, moves: list[tuple[int, int]], k_gpu: torch.Tensor, v_gpu: torch.Tensor):
        """Copy every layer of GPU block ``g`` into host block ``h`` for each ``(g, h)`` of
        ``moves``, in order, after the compute stream's work so far; the compute stream then waits
        for the copies (the GPU blocks are rewritten in this step).

        Args:
            k_gpu, v_gpu: the GPU tier, ``[L, num_gpu_blocks, block_size, Hkv, D]``.
        """
        self.step_start.record(self._compute_stream())
        self.spill_stream.wait_event(self.step_start)
        gpu_pitch, host_pitch = k_gpu.stride(0) * k_gpu.element_size(), self.num_blocks * self.block_bytes
        kind = "d2h" if self.cuda else "h2h"
        stream = self.spill_stream if self.cuda else None
        for gpu_id, host_id in moves:
            for src, dst in ((k_gpu, self.k_host), (v_gpu, self.v_host)):
                memcpy_2d_async(dst[0, host_id], src[0, gpu_id], host_pitch, gpu_pitch, self.block_bytes,
                                self.num_layers, kind, stream)
        self.spill_done.record(self.spill_stream)
        self._compute_stream().wait_event(self.spill_done)
        self.bytes_d2h += 2 * len(moves) * self.num_layers * self.block_bytes

    # ---- ring --------------------------------------------------------------------------
    def load(self, slot: int, layer: int, host_id: int, stream: int | None = None):
        """Start copying ``layer`` of host block ``host_id`` into ring ``slot`` (H2D on transfer
        stream ``stream``, by default the slot's, after the slot's previous reader and the step's
        spills)."""
        stream = self.transfer_streams[slot if stream is None else stream]
        stream.wait_event(self.slot_free[slot])
        stream.wait_event(self.spill_done)
        with self._stream_ctx(stream):
            self.k_slots[slot].copy_(self.k_host[layer, host_id], non_blocking=True)
            self.v_slots[slot].copy_(self.v_host[layer, host_id], non_blocking=True)
            self.slot_ready[slot].record(stream)
        self.bytes_h2d += 2 * self.block_bytes

    def wait(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the compute stream wait for ``slot``'s load; returns its keys and values
        ``[block_size, Hkv, D]`` each."""
        self._compute_stream().wait_event(self.slot_ready[slot])
        return self.k_slots[slot], self.v_slots[slot]

    def release(self, slot: int):
        """``slot`` may be overwritten once the compute stream's work so far is done."""
        self.slot_free[slot].record(self._compute_stream())

    # ---- gathers -----------------------------------------------------------------------
    def read_block(self, layer: int, host_id: int, k_out: torch.Tensor, v_out: torch.Tensor):
        """Copy ``layer`` of host block ``host_id`` into ``k_out`` / ``v_out`` ``[block_size, Hkv,
        D]`` on the compute stream."""
        k_out.copy_(self.k_host[layer, host_id], non_blocking=True)
        v_out.copy_(self.v_host[layer, host_id], non_blocking=True)
        self.bytes_h2d += 2 * self.block_bytes

    def gather_pages(self, layer: int, src_pages: torch.Tensor, heads: torch.Tensor, k_pages: torch.Tensor,
                     v_pages: torch.Tensor, dst_pages: torch.Tensor):
        """Gather KV head ``heads[i]`` of ``layer``'s host page ``src_pages[i]`` (device ``[n]``, -1:
        skip) into the same head of page ``dst_pages[i]`` of ``k_pages`` / ``v_pages`` (``[pages,
        page_size, Hkv, D]``) on the compute stream, the ids never read on the host
        (:func:`nanovllm.ops.gather_host_pages`); counts the bytes as a device tensor."""
        page = k_pages.shape[1]
        k_host, v_host = (cache[layer].view(-1, page, *cache.shape[3:]) for cache in (self.k_host, self.v_host))
        gather_host_pages(k_host, v_host, src_pages, heads, k_pages, v_pages, dst_pages)
        self._gathered_bytes = self._gathered_bytes + (src_pages >= 0).sum() * self.page_head_bytes(page)

    def loaded_bytes(self) -> int:
        """Bytes read from this tier so far, copies and gathers (syncs with the device once)."""
        return self.bytes_h2d + int(self._gathered_bytes)

    def page_head_bytes(self, page_size: int) -> int:
        """Bytes of one KV head's keys and values of one page of ``page_size`` tokens of one layer."""
        return 2 * self.block_bytes // self.block_size // self.k_host.shape[3] * page_size

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one layer of one block, keys and values."""
        return 2 * self.block_bytes

    def synchronize(self):
        """Block the host until every copy of this tier finished."""
        if self.cuda:
            self.spill_stream.synchronize()
            for stream in self.transfer_streams:
                stream.synchronize()

"""The host tier of the KV cache: host blocks (pinned on demand, ``host_memory.py``), the GPU
ring buffer that decode reads them through, and every copy between host and GPU with its streams
and events. A choosing policy's host pages are not copied but gathered per (page, KV head)
(:meth:`HostTier.gather_pages`): a kernel on the compute stream, after the step's moves, reads the
pinned pages in place (:func:`nanovllm.ops.gather_host_pages`); their bytes are counted on the
device.

Memory (per rank, ``L`` layers, ``Nh`` host blocks, ``N`` ring slots):

    host  k_host, v_host  [L, Nh, block_size, Hkv, D]   layer-major (layer stride: a page multiple),
                                                        pinned chunk by chunk as blocks are used
    GPU   k_slots, v_slots [N, block_size, Hkv, D]      the ring (one layer of one block per slot)

An fp8 tier (``scaled``) keeps each block's float32 scales beside it, ``k_host_scale``,
``v_host_scale`` ``[L, Nh, block_size, Hkv]`` (``HostMemory``'s: allocated at once, pinned on
CUDA, counted in its capacity and pinned bytes; 4 bytes per (token, KV head), a few percent of
the blocks), and the ring ``k_slot_scales``, ``v_slot_scales``
``[N, block_size, Hkv]``; every copy below moves a block's scales with it, in the same stream
order, so a block is never requantized whatever tier it lives in.

Streams and events (CUDA; on CPU every copy is synchronous and events are no-ops):

    compute (the model's current stream): record step_start -> wait moves_done -> forward ...
                                          wait half_ready[h] -> attend half h -> record half_free[h]
    spill stream:     wait step_start -> the keys of each move of the step, in order, then the
                      values, then an fp8 tier's scales (the tensors do not overlap), all layers of
                      a block per copy (cudaMemcpy2DAsync, strided by layer on both sides; a layer
                      per copy where host memory is pinned on demand; D2H for spills and
                      write-backs, H2D for load-backs) -> record moves_done -> the write-backs
                      ahead of reuse, the same way -> record ahead_done (the next step's compute
                      waits for it: wait_ahead)
    transfer stream:  wait half_free[h], moves_done -> H2D of one layer of a group of host blocks
                      into half h of the ring's slots, one copy per run of consecutive blocks
                      inside one registration (:func:`copy_runs`) -> record half_ready[h]

The ring's slots are used in two halves (``ring.py`` plans which group of loads goes to which), so
one half loads while the other is read; the transfer stream is one, so loads land in plan order.

``step_start`` is recorded when the host begins step N+1, after it enqueued all of step N on the
compute stream; so the moves of N+1 start once the device finished step N, even with async
scheduling (N+1 decided while N runs): a move never reads a block step N writes (spills take full
blocks) nor writes one it reads. Gathers for prefill (:meth:`HostTier.read_blocks`) copy on the
compute stream itself, after it waited for the step's moves.
"""
import contextlib

import torch

from nanovllm.kvcache.eviction import BlockMove
from nanovllm.kvcache.host_memory import HostMemory
from nanovllm.kvcache.memcpy2d import memcpy_2d_moves_async
from nanovllm.ops import gather_host_pages
from nanovllm.ops.kv_quant import SCALE_DTYPE


def copy_runs(blocks: list[tuple[int, int]], registration_blocks: int | None) -> list[tuple[int, int, int]]:
    """``(index, host block)`` pairs grouped into copies: ``(first index, first host block, count)``
    for each run of pairs consecutive in both, cut where a run would leave one registration of
    ``registration_blocks`` host blocks (``HostMemory.registration_blocks``; None: one allocation),
    since one copy must stay inside one (``host_memory.py``)."""
    runs: list[list[int]] = []
    for index, host_id in blocks:
        if runs:
            first_index, first_host, count = runs[-1]
            if (index == first_index + count and host_id == first_host + count
                    and (registration_blocks is None or host_id // registration_blocks == first_host // registration_blocks)):
                runs[-1][2] += 1
                continue
        runs.append([index, host_id, 1])
    return [tuple(run) for run in runs]


class _NullStream:
    """Stands in for a CUDA stream on CPU: work is already ordered."""

    def wait_event(self, event):
        pass


class _NullEvent:
    def record(self, stream=None):
        pass


class HostTier:
    """Args: num_layers, block_size, num_kv_heads, head_dim, dtype, device (the KV geometry of
    this rank; ``dtype`` the stored elements'); num_blocks (host blocks, >= 1); num_slots (ring
    slots, >= 2); chunk_bytes (bytes pinned at a time, ``host_memory.PIN_CHUNK_BYTES`` by default);
    scaled (an fp8 tier: float32 scales per (token, KV head) beside keys and values); on_demand
    (``HostMemory``'s).

    Raises:
        RuntimeError: host memory cannot be mapped or pinned (with the byte counts).
    """

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, num_slots: int, chunk_bytes: int | None = None,
                 scaled: bool = False, on_demand: bool | None = None):
        self.num_layers, self.block_size, self.num_blocks = num_layers, block_size, num_blocks
        self.num_slots, self.device, self.cuda = num_slots, device, device.type == "cuda"
        block_shape = (block_size, num_kv_heads, head_dim)
        scale_shape = (block_size, num_kv_heads)
        self.memory = HostMemory(num_layers, num_blocks, block_shape, dtype, device, chunk_bytes, on_demand,
                                 scale_shape if scaled else None)
        self.k_host, self.v_host = self.memory.k, self.memory.v
        self.k_host_scale, self.v_host_scale = self.memory.k_scale, self.memory.v_scale
        # Uninitialised on purpose: a slot is written before it is read, valid lengths bound reads.
        self.k_slots, self.v_slots = (torch.empty(num_slots, *block_shape, dtype=dtype, device=device)
                                      for _ in range(2))
        self.block_bytes = self.memory.block_bytes
        """Bytes of one layer of one block, keys or values (without scales)."""
        self.k_slot_scales = self.v_slot_scales = None
        self.scale_block_bytes = 0
        """Bytes of one layer of one block's scales, keys or values (0 unscaled)."""
        if scaled:
            self.k_slot_scales, self.v_slot_scales = (torch.ones((num_slots, *scale_shape), dtype=SCALE_DTYPE,
                                                                 device=device) for _ in range(2))
            self.scale_block_bytes = block_size * num_kv_heads * SCALE_DTYPE.itemsize
        self.bytes_h2d = 0  # copies to the device issued by the host
        self._gathered_bytes = torch.zeros((), dtype=torch.int64, device=device)  # by the gather kernel, in place
        self._make_streams()

    def _make_streams(self):
        if self.cuda:
            new_event = torch.cuda.Event
            self.transfer_stream = torch.cuda.Stream(self.device)
            self.spill_stream = torch.cuda.Stream(self.device)
        else:
            new_event = _NullEvent
            self.transfer_stream = self.spill_stream = _NullStream()
        self.half_ready = [new_event() for _ in range(2)]
        self.half_free = [new_event() for _ in range(2)]
        self.step_start, self.spill_done, self.ahead_done = new_event(), new_event(), new_event()
        self.ahead_pending = False

    def _stream_ctx(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def _compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else _NullStream()

    # ---- moves between the tiers -------------------------------------------------------
    def move(self, moves: list[BlockMove], k_gpu: torch.Tensor, v_gpu: torch.Tensor,
             gpu_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Copy every layer of each move's block (``eviction.BlockMove``: GPU to host when
        ``to_host``, else host to GPU), in order, on the spill stream, after the compute stream's
        work so far; the compute stream then waits for the copies (this step rewrites GPU blocks
        moved to the host and reads those moved to the GPU), but for the ``ahead`` ones (last in
        ``moves``), which overlap the step and which the next step waits for (:meth:`wait_ahead`).
        Waits first (logged) if a host block is not pinned yet, and keeps the pinning a chunk ahead.

        Args:
            k_gpu, v_gpu: the GPU tier, ``[L, num_gpu_blocks, block_size, Hkv, D]``.
            gpu_scales: an fp8 tier's GPU-tier scales ``(k, v)``, ``[L, num_gpu_blocks,
                block_size, Hkv]`` each, moved with their blocks (None unscaled).
        """
        if not moves:
            return
        self.memory.ensure(1 + max(m.host for m in moves))
        self.step_start.record(self._compute_stream())
        self.spill_stream.wait_event(self.step_start)
        now, ahead = [m for m in moves if not m.ahead], [m for m in moves if m.ahead]  # independent sets
        if now:
            self._copy(now, k_gpu, v_gpu, gpu_scales)
        self.spill_done.record(self.spill_stream)
        self._compute_stream().wait_event(self.spill_done)
        if ahead:
            self._copy(ahead, k_gpu, v_gpu, gpu_scales)
            self.ahead_done.record(self.spill_stream)
            self.ahead_pending = True
        self.bytes_h2d += sum(not m.to_host for m in moves) * self.num_layers * self.layer_block_bytes

    def wait_ahead(self):
        """The compute stream waits for the last step's write-backs ahead of reuse (before this
        step's forward may rewrite the blocks they read)."""
        if self.ahead_pending:
            self._compute_stream().wait_event(self.ahead_done)
            self.ahead_pending = False

    def _copy(self, moves: list[BlockMove], k_gpu, v_gpu, gpu_scales):
        """``moves`` in order on the spill stream: one call per tensor (keys, values, scales)."""
        # (first layer, layers) per copy: all at once where the host side is one allocation, else a
        # layer at a time (one copy must stay inside one registration: host_memory.py)
        all_layers = [(0, self.num_layers)]
        runs = all_layers if self.memory.one_allocation else [(layer, 1) for layer in range(self.num_layers)]
        pairs = [(k_gpu, self.k_host, runs), (v_gpu, self.v_host, runs)]
        if gpu_scales is not None:  # the scales are pinned at once
            pairs += [(gpu_scales[0], self.k_host_scale, all_layers), (gpu_scales[1], self.v_host_scale, all_layers)]
        stream = self.spill_stream if self.cuda else None
        to_host = [m.to_host for m in moves]
        for gpu, host, layer_runs in pairs:  # one call per tensor pair: the moves in their order
            gpu_pitch, gpu_block = (n * gpu.element_size() for n in gpu.stride()[:2])
            host_pitch, host_block = (n * host.element_size() for n in host.stride()[:2])
            width = host[0, 0].numel() * host.element_size()
            height = layer_runs[0][1]  # every run: all layers, or one
            gpu_offsets = [first * gpu_pitch + m.gpu * gpu_block for m in moves for first, _ in layer_runs]
            host_offsets = [first * host_pitch + m.host * host_block for m in moves for first, _ in layer_runs]
            memcpy_2d_moves_async(gpu, host, gpu_offsets, host_offsets, [up for up in to_host for _ in layer_runs],
                                  gpu_pitch, host_pitch, width, height, stream)

    # ---- ring --------------------------------------------------------------------------
    def load(self, half: int, first_slot: int, layer: int, host_ids: list[int]):
        """Start copying ``layer`` of host blocks ``host_ids`` into slots ``first_slot ..
        first_slot + len(host_ids) - 1`` (all in ring half ``half``): H2D on the transfer stream,
        after the half's previous reader and the step's moves, one copy per run (:func:`copy_runs`)."""
        stream = self.transfer_stream
        stream.wait_event(self.half_free[half])
        stream.wait_event(self.spill_done)
        pairs = [(self.k_slots, self.k_host), (self.v_slots, self.v_host)]
        if self.k_host_scale is not None:
            pairs += [(self.k_slot_scales, self.k_host_scale), (self.v_slot_scales, self.v_host_scale)]
        with self._stream_ctx(stream):
            for offset, host_id, count in copy_runs(list(enumerate(host_ids)), self.memory.registration_blocks):
                slots = slice(first_slot + offset, first_slot + offset + count)
                for slot_buf, host in pairs:
                    slot_buf[slots].copy_(host[layer, host_id:host_id + count], non_blocking=True)
            self.half_ready[half].record(stream)
        self.bytes_h2d += len(host_ids) * self.layer_block_bytes

    def wait(self, half: int):
        """Make the compute stream wait for the loads into ring half ``half``."""
        self._compute_stream().wait_event(self.half_ready[half])

    def slots(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                      torch.Tensor | None]:
        """Slots ``first .. first + count - 1``: keys and values ``[count, block_size, Hkv, D]`` and
        their scales ``[count, block_size, Hkv]`` (None unscaled)."""
        rows = slice(first, first + count)
        if self.k_slot_scales is None:
            return self.k_slots[rows], self.v_slots[rows], None, None
        return self.k_slots[rows], self.v_slots[rows], self.k_slot_scales[rows], self.v_slot_scales[rows]

    def release(self, half: int):
        """Ring half ``half`` may be overwritten once the compute stream's work so far is done."""
        self.half_free[half].record(self._compute_stream())

    # ---- gathers -----------------------------------------------------------------------
    def read_blocks(self, layer: int, blocks: list[tuple[int, int]], k_out: torch.Tensor, v_out: torch.Tensor,
                    scales_out: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Copy ``layer`` of each ``(index, host block)`` of ``blocks`` into row ``index`` of ``k_out``
        / ``v_out`` ``[n, block_size, Hkv, D]`` (an fp8 tier: its scales into ``scales_out`` ``[n,
        block_size, Hkv]`` each) on the compute stream, one copy per run of consecutive indices and
        blocks (:func:`copy_runs`)."""
        pairs = [(k_out, self.k_host), (v_out, self.v_host)]
        if scales_out is not None:
            pairs += [(scales_out[0], self.k_host_scale), (scales_out[1], self.v_host_scale)]
        for index, host_id, count in copy_runs(blocks, self.memory.registration_blocks):
            for out, host in pairs:
                out[index:index + count].copy_(host[layer, host_id:host_id + count], non_blocking=True)
        self.bytes_h2d += len(blocks) * self.layer_block_bytes

    def gather_pages(self, layer: int, src_pages: torch.Tensor, heads: torch.Tensor, k_pages: torch.Tensor,
                     v_pages: torch.Tensor, dst_pages: torch.Tensor,
                     scale_pages: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Gather KV head ``heads[i]`` of ``layer``'s host page ``src_pages[i]`` (device ``[n]``, -1:
        skip) into the same head of page ``dst_pages[i]`` of ``k_pages`` / ``v_pages`` (``[pages,
        page_size, Hkv, D]``; an fp8 tier: with its scales, into ``scale_pages`` ``[pages,
        page_size, Hkv]`` each) on the compute stream, the ids never read on the host
        (:func:`nanovllm.ops.gather_host_pages`); counts the bytes on the device. With nothing
        pinned yet no host page exists and nothing is launched (``KVCache.allocate`` pins the first
        chunk, ``HostMemory.pin_first_chunk``, before any CUDA-graph capture of the gather)."""
        if self.memory.pinned_blocks == 0:
            return
        page = k_pages.shape[1]
        k_host, v_host = (cache[layer].view(-1, page, *cache.shape[3:]) for cache in (self.k_host, self.v_host))
        src_scales = None if scale_pages is None else tuple(
            scale[layer].view(-1, page, scale.shape[3]) for scale in (self.k_host_scale, self.v_host_scale))
        gather_host_pages(k_host, v_host, src_pages, heads, k_pages, v_pages, dst_pages, src_scales, scale_pages)
        self._gathered_bytes.add_((src_pages >= 0).sum(), alpha=self.page_head_bytes(page))  # a graph's replays count

    def loaded_bytes(self) -> int:
        """Bytes read from this tier so far, copies and gathers (syncs with the device once)."""
        return self.bytes_h2d + int(self._gathered_bytes)

    def page_head_bytes(self, page_size: int) -> int:
        """Bytes of one KV head's keys and values of one page of ``page_size`` tokens of one layer
        (scales included)."""
        return self.layer_block_bytes // self.block_size // self.k_host.shape[3] * page_size

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one layer of one block, keys and values (scales included)."""
        return 2 * (self.block_bytes + self.scale_block_bytes)

    def synchronize(self):
        """Block the host until every copy of this tier finished."""
        if self.cuda:
            self.spill_stream.synchronize()
            self.transfer_stream.synchronize()

    def free_memory(self):
        """Stop pinning and unpin the host blocks (after :meth:`synchronize`; the engine is done
        with this tier)."""
        self.synchronize()
        self.memory.release()

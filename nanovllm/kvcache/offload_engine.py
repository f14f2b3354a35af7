"""Pinned host KV cache, GPU ring buffer, prefill and decode buffers, streams and events.

Memory (per rank):

    host    k_cpu, v_cpu     [num_layers, num_cpu_blocks, block_size, Hkv, D]   layer-major, pinned
    GPU     k_slots, v_slots [num_slots, block_size, Hkv, D]                    ring buffer (one layer)
            k_prefill, ...   [num_layers, block_size, Hkv, D]                   current prefill chunk
            k_decode, ...    [num_decode_rows, num_layers, block_size, Hkv, D]  tokens since last full block

Streams and events (CUDA; on CPU every copy is synchronous and events are no-ops):

    transfer stream s (one per slot):  wait compute_done[s], offload_done[layer], decode_offload_done
                                       -> H2D layer of a block into slot s -> record ready[s]
    compute stream (the model's):      wait ready[s] -> attention on slot s -> record compute_done[s]
    offload stream:                    wait chunk_written[layer] -> D2H prefill buffer -> record
                                       offload_done[layer]; decode blocks go all layers at once
                                       through cudaMemcpy2DAsync (strided across layers)

Every cross-stream hand-off goes through an event; policies never copy host tensors themselves.
"""
import contextlib
import logging

import torch

from nanovllm.comm.sgdma import memcpy_2d_async

logger = logging.getLogger(__name__)


class _NullStream:
    """Stands in for a CUDA stream on CPU: work is already ordered."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class _NullEvent:
    def record(self, stream=None):
        pass


class OffloadEngine:
    """Owns every offload-mode KV buffer and all host<->device movement.

    Args:
        num_layers, num_kv_heads, head_dim, dtype, device: the model's KV geometry (this rank).
        block_size: tokens per block (= prefill chunk).
        num_cpu_blocks: host blocks. num_slots: ring-buffer slots (>= 2).
        num_decode_rows: sequences that can decode at once (one decode buffer each).

    Raises:
        RuntimeError: host memory cannot be allocated or pinned (with the byte counts).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, num_cpu_blocks: int, num_slots: int,
                 num_decode_rows: int):
        self.num_layers, self.block_size = num_layers, block_size
        self.num_cpu_blocks, self.num_slots = num_cpu_blocks, num_slots
        self.device, self.cuda = device, device.type == "cuda"
        block_shape = (block_size, num_kv_heads, head_dim)
        self.k_cpu, self.v_cpu = (self._host_cache((num_layers, num_cpu_blocks, *block_shape), dtype)
                                  for _ in range(2))
        # Uninitialised on purpose: every slot, buffer row and host block is written before it is
        # read (valid lengths bound every read), and untouched pages cost nothing on the host.
        gpu = dict(dtype=dtype, device=device)
        self.k_slots, self.v_slots = (torch.empty(num_slots, *block_shape, **gpu) for _ in range(2))
        self.k_prefill, self.v_prefill = (torch.empty(num_layers, *block_shape, **gpu) for _ in range(2))
        self.k_decode, self.v_decode = (torch.empty(num_decode_rows, num_layers, *block_shape, **gpu)
                                        for _ in range(2))
        self.block_bytes = block_size * num_kv_heads * head_dim * dtype.itemsize
        self.bytes_h2d = self.bytes_d2h = 0
        self._prefetched: dict[int, tuple[int, int]] = {}  # slot -> (layer, cpu_block) in flight
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
            self.offload_stream = torch.cuda.Stream(self.device)
        else:
            new_event = _NullEvent
            self.transfer_streams = [_NullStream() for _ in range(self.num_slots)]
            self.offload_stream = _NullStream()
        self.slot_ready = [new_event() for _ in range(self.num_slots)]
        self.slot_compute_done = [new_event() for _ in range(self.num_slots)]
        self.chunk_written = [new_event() for _ in range(self.num_layers)]
        self.offload_done = [new_event() for _ in range(self.num_layers)]
        self.decode_written = new_event()
        self.decode_offload_done = new_event()

    def _stream_ctx(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def _compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else _NullStream()

    # ---- ring buffer -------------------------------------------------------------------
    def load_to_slot_layer(self, slot: int, layer: int, cpu_block: int, reuse_prefetch: bool = False,
                           values: bool = True):
        """Start copying ``layer`` of ``cpu_block`` into ring ``slot`` (H2D, async on the slot's
        stream, after the slot's previous reader and the block's pending offload finished).
        With ``reuse_prefetch``, a pending prefetch of the same layer and block into this slot
        is taken instead of a second copy. ``values=False`` copies the keys only (estimation
        passes): the slot's values are then stale and must not be read."""
        if reuse_prefetch and self._prefetched.pop(slot, None) == (layer, cpu_block):
            return
        stream = self.transfer_streams[slot]
        stream.wait_event(self.slot_compute_done[slot])
        stream.wait_event(self.offload_done[layer])
        stream.wait_event(self.decode_offload_done)
        with self._stream_ctx(stream):
            self.k_slots[slot].copy_(self.k_cpu[layer, cpu_block], non_blocking=True)
            if values:
                self.v_slots[slot].copy_(self.v_cpu[layer, cpu_block], non_blocking=True)
            self.slot_ready[slot].record(stream)
        self.bytes_h2d += (2 if values else 1) * self.block_bytes

    def prefetch_to_slot_layer(self, slot: int, layer: int, cpu_block: int):
        """``load_to_slot_layer`` on behalf of the next attention call, before it starts; that
        call takes it with ``reuse_prefetch=True`` if it wants the same block in the same slot."""
        self.load_to_slot_layer(slot, layer, cpu_block)
        self._prefetched[slot] = (layer, cpu_block)

    def prefetched_slots(self, layer: int) -> dict[int, int]:
        """``{cpu_block: slot}`` of the pending prefetches of ``layer``."""
        return {block: slot for slot, (lay, block) in self._prefetched.items() if lay == layer}

    def drop_prefetches(self):
        """Forget prefetches the current call did not take (called once its first loads are
        issued, at every step start and on reset; a stale entry must never match later)."""
        self._prefetched.clear()

    def wait_slot_layer(self, slot: int):
        """Make the compute stream wait until ``slot``'s load has landed."""
        self._compute_stream().wait_event(self.slot_ready[slot])

    def get_kv_for_slot(self, slot: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` keys and values in ``slot``: ``[num_tokens, Hkv, D]`` each."""
        return self.k_slots[slot, :num_tokens], self.v_slots[slot, :num_tokens]

    def record_slot_compute_done(self, slot: int):
        """Mark ``slot`` free to overwrite once the compute stream's work so far is done."""
        self.slot_compute_done[slot].record(self._compute_stream())

    # ---- prefill buffer ----------------------------------------------------------------
    def write_prefill_buffer(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Copy the chunk's ``k, v [n, Hkv, D]`` into ``layer``'s prefill buffer (after its
        previous offload finished); returns the buffer views ``[n, Hkv, D]``."""
        n = k.size(0)
        self._compute_stream().wait_event(self.offload_done[layer])
        self.k_prefill[layer, :n].copy_(k)
        self.v_prefill[layer, :n].copy_(v)
        return self.k_prefill[layer, :n], self.v_prefill[layer, :n]

    def offload_prefill_buffer_async(self, layer: int, cpu_block: int, num_tokens: int):
        """D2H of ``layer``'s prefill buffer (first ``num_tokens``) into ``cpu_block``, without
        waiting for it."""
        self.chunk_written[layer].record(self._compute_stream())
        self.offload_stream.wait_event(self.chunk_written[layer])
        with self._stream_ctx(self.offload_stream):
            self.k_cpu[layer, cpu_block, :num_tokens].copy_(self.k_prefill[layer, :num_tokens], non_blocking=True)
            self.v_cpu[layer, cpu_block, :num_tokens].copy_(self.v_prefill[layer, :num_tokens], non_blocking=True)
            self.offload_done[layer].record(self.offload_stream)
        self.bytes_d2h += 2 * num_tokens * self.block_bytes // self.block_size

    # ---- decode buffer -----------------------------------------------------------------
    def store_decode_tokens(self, layer: int, rows: torch.Tensor, offsets: torch.Tensor,
                            k: torch.Tensor, v: torch.Tensor):
        """Write each sequence's new ``k, v [batch, Hkv, D]`` at ``offsets`` of its decode ``rows``."""
        self._compute_stream().wait_event(self.decode_offload_done)
        self.k_decode[rows, layer, offsets] = k
        self.v_decode[rows, layer, offsets] = v

    def decode_buffer(self, layer: int, row: int, num_tokens: int):
        """The first ``num_tokens`` decode-buffer keys and values of ``row``: ``[n, Hkv, D]``."""
        return self.k_decode[row, layer, :num_tokens], self.v_decode[row, layer, :num_tokens]

    def offload_decode_block(self, row: int, cpu_block: int):
        """D2H of a full decode buffer (every layer) into ``cpu_block``: one 2D copy per cache,
        strided across layers on the host side (cudaMemcpy2DAsync)."""
        self.decode_written.record(self._compute_stream())
        self.offload_stream.wait_event(self.decode_written)
        layer_pitch = self.num_cpu_blocks * self.block_bytes
        for src, dst in ((self.k_decode, self.k_cpu), (self.v_decode, self.v_cpu)):
            memcpy_2d_async(dst[0, cpu_block], src[row], layer_pitch, self.block_bytes,
                            self.block_bytes, self.num_layers, "d2h" if self.cuda else "h2h",
                            self.offload_stream if self.cuda else None)
        self.decode_offload_done.record(self.offload_stream)
        self.bytes_d2h += 2 * self.num_layers * self.block_bytes

    def decode_block(self, row: int) -> torch.Tensor:
        """All layers' keys of a decode row ``[num_layers, block_size, Hkv, D]`` (for hooks)."""
        return self.k_decode[row]

    def wait_all_offloads(self):
        """Block the host until every pending D2H copy finished."""
        if self.cuda:
            self.offload_stream.synchronize()

    def reset(self):
        """Forget transfer counters (buffers are overwritten before they are read again)."""
        self.wait_all_offloads()
        self.drop_prefetches()
        self.bytes_h2d = self.bytes_d2h = 0

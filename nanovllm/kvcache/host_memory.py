"""The host tier's memory, pinned on demand: one pageable anonymous mapping whose ranges are
page-locked chunk by chunk, by a background thread, ahead of the blocks the tier hands out.

Layout (``L`` layers, ``Nh`` host blocks of ``block_bytes`` per layer, keys or values):

    keys    [L, Nh, block_size, Hkv, D]   layer l at byte l * layer_stride of the mapping
    values  [L, Nh, block_size, Hkv, D]   at byte (L + l) * layer_stride
    layer_stride = Nh * block_bytes rounded up to a page

One mapping and one tensor each for keys and values, so every address handed out stays valid as
more of it is pinned: ring loads, the strided spill copies (``memcpy2d``) and the UVA gather
kernel (``nanovllm.ops.gather_host_blocks``) read and write the same tensors before and after.
An untouched page costs nothing, so the capacity (what admission counts) is free until used.

**Chunks.** Chunk ``c`` is host blocks ``c * chunk_blocks .. (c + 1) * chunk_blocks - 1``. It is
pinned by registering (``cudaHostRegister``, portable and mapped), for keys and values of every
layer, the bytes from its first block to the next chunk's first block (the last chunk's: to the end
of the layer's page-rounded stride), one call per range (:meth:`HostMemory.chunk_ranges`).
``chunk_blocks`` is a multiple of ``PAGESIZE / gcd(block_bytes, PAGESIZE)``, so every chunk starts
on a page and its ranges tile the mapping without overlap; chunks are pinned in order, so block
``b`` is pinned once :attr:`HostMemory.pinned_blocks` ``> b``. A range's pages are faulted in first
(zeroed by the kernel: CPU work that holds no driver lock), then registered, with a pause after
each call (:data:`PIN_DUTY`): a ``cudaHostRegister`` call holds the driver, so a step's CUDA calls
on another thread wait for it; the pause keeps that rare. The thread pauses only while what it has
pinned ends a chunk or more beyond the blocks in use (the largest :meth:`HostMemory.reserve`, which
ends a pause when it moves that mark): the chunk after the blocks in use is pinned at once (a pause
would soon make a step wait, and a step waiting in :meth:`HostMemory.ensure` gains nothing from
one); the chunks further ahead, asked for once a step had to wait (``ahead_blocks`` doubled), are
paced.

**One registration per copy.** A ``cudaMemcpy2DAsync`` (or ``cudaMemcpyAsync``) whose host region
spans two registrations crashes the process (SIGSEGV inside the driver; one region inside one
registration copies correctly while another thread registers more). Each layer's block lies in one
registration, but one block's layers lie in as many, so on-demand memory is copied a layer at a
time: :attr:`HostMemory.one_allocation` tells the copies whether one may span layers.

**When.** Pinning starts with :meth:`HostMemory.start` (the engine calls it once the CUDA graphs
are captured: registering memory during a capture would break it) and stays ahead of use:
:meth:`HostMemory.reserve` (blocks below ``n`` are written now) asks the thread for every chunk up
to block ``n + ahead_blocks``; :meth:`HostMemory.ensure` also waits until blocks below ``n`` are
pinned (a step that must wait is logged and counted in :attr:`HostMemory.wait_s`). ``ahead_blocks``
starts at one chunk and doubles after each wait (up to the capacity): use that outruns the thread
(a burst of spills or prefix write-backs) makes it pin further ahead, so that its pauses overlap
the steps instead of delaying them.
:meth:`HostMemory.release` stops the thread and unregisters everything.

**Scales.** An fp8 tier's float32 scales (``scale_shape`` per block and layer, keys and values:
:attr:`HostMemory.k_scale`, :attr:`HostMemory.v_scale` ``[L, Nh, *scale_shape]``, a few percent of
the blocks) are two allocations of their own, pinned at once on CUDA (``cudaHostAlloc``), so a copy
of one block's scales of every layer lies inside one allocation; they are counted in
:attr:`HostMemory.capacity_bytes` and :attr:`HostMemory.bytes_pinned` from the start.

**Device access.** The gather kernel reads pinned memory through its host address, which needs
``cudaDevAttrCanUseHostPointerForRegisteredMem``: at construction one page is registered and its
device pointer (``cuPointerGetAttribute``) compared with its host pointer. If they differ (or the
driver cannot be asked), the tier is allocated pinned at once with ``cudaHostAlloc`` (whose
pointers agree under unified addressing) and nothing is pinned later. On CPU nothing is pinned,
but the same chunks, thread and counts run (``register`` only records), so CI tests them.
"""
import ctypes
import logging
import math
import mmap
import threading
import time

import torch

from nanovllm.ops.kv_quant import SCALE_DTYPE

logger = logging.getLogger(__name__)

PIN_CHUNK_BYTES = 1 << 30
"""Bytes per chunk (keys and values of every layer), rounded to whole blocks, at least one."""
PIN_DUTY = 0.25
"""Share of the time the pinning thread spends registering when it pins a chunk or more beyond the
blocks in use: after a call of ``t`` seconds it sleeps ``t * (1 / PIN_DUTY - 1)``, so that the steps'
launches rarely queue behind it (module doc)."""
_REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3  # CUpointer_attribute (2 is the memory type)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _cudart_call(name: str, *args):
    """Call ``torch.cuda.cudart().<name>``; raises RuntimeError with CUDA's text on an error."""
    cudart = torch.cuda.cudart()
    err = getattr(cudart, name)(*args)
    if err != cudart.cudaError.success:
        raise RuntimeError(f"{name} failed: {cudart.cudaGetErrorString(err)}")


def register_host_range(address: int, size: int) -> None:
    """Page-lock ``size`` bytes of host memory at ``address`` as the host tier does
    (``cudaHostRegister``, portable and mapped).

    Raises:
        RuntimeError: a CUDA error, with CUDA's text.
    """
    _cudart_call("cudaHostRegister", address, size, _REGISTER_FLAGS)


def unregister_host_range(address: int) -> None:
    """Undo :func:`register_host_range` of the range starting at ``address``
    (``cudaHostUnregister``); RuntimeError with CUDA's text on an error."""
    _cudart_call("cudaHostUnregister", address)


def registered_pointers_agree() -> bool:
    """Whether the device reads registered host memory at its host address (one page registered,
    its device pointer compared with its host pointer, then unregistered); False when it cannot
    be told."""
    page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    ptr = torch.frombuffer(page, dtype=torch.uint8).data_ptr()
    try:
        register_host_range(ptr, mmap.PAGESIZE)
    except (RuntimeError, AttributeError):
        return False
    try:
        device_ptr = ctypes.c_uint64(0)
        status = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute(
            ctypes.byref(device_ptr), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER, ctypes.c_uint64(ptr))
        return status == 0 and device_ptr.value == ptr
    except OSError:
        return False
    finally:
        unregister_host_range(ptr)


class HostMemory:
    """Keys and values of the host tier (module doc): :attr:`k`, :attr:`v` ``[num_layers,
    num_blocks, *block_shape]`` of ``dtype`` on the CPU, and an fp8 tier's scales :attr:`k_scale`,
    :attr:`v_scale` ``[num_layers, num_blocks, *scale_shape]`` float32 (None without).

    Args: num_layers; num_blocks (>= 1); block_shape (``(block_size, Hkv, D)``); dtype; device
    (CUDA: registered chunk by chunk; CPU: the same bookkeeping, nothing registered); chunk_bytes
    (default :data:`PIN_CHUNK_BYTES`, rounded to whole blocks starting on a page); on_demand (pin
    chunk by chunk; default: yes, unless the device cannot read registered memory at its host
    address (:func:`registered_pointers_agree`), then pinned at once; False: pinned at once);
    scale_shape (the scales of one layer of one block, keys or values: ``(block_size, Hkv)``;
    None: no scales), allocated filled with 1.0 and pinned at once on CUDA.

    Raises:
        RuntimeError: the memory cannot be mapped or (the eager fallback) pinned, with the bytes.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, chunk_bytes: int | None = None, on_demand: bool | None = None,
                 scale_shape: tuple[int, ...] | None = None):
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # the pinning thread sets this device
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_layers, self.num_blocks, self.device = num_layers, num_blocks, device
        block_elems = math.prod(block_shape)
        self.block_bytes = block_elems * dtype.itemsize
        """Bytes of one layer of one block, keys or values."""
        chunk_bytes = PIN_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        page_blocks = mmap.PAGESIZE // math.gcd(self.block_bytes, mmap.PAGESIZE)  # blocks per page-aligned start
        chunk_blocks = max(1, chunk_bytes // (2 * num_layers * self.block_bytes))
        self.chunk_blocks = min(num_blocks, _round_up(chunk_blocks, page_blocks))
        self.num_chunks = -(-num_blocks // self.chunk_blocks)
        self.layer_stride = _round_up(num_blocks * self.block_bytes, mmap.PAGESIZE)
        self.kv_bytes = 2 * num_layers * self.layer_stride
        """Bytes of keys and values (page-rounded layer strides; the mapping on demand)."""
        self.k_scale = self.v_scale = None
        self.scale_bytes = 0
        """Bytes of the scales, keys and values (0 without)."""
        if scale_shape is not None:
            self.k_scale, self.v_scale = (torch.ones((num_layers, num_blocks, *scale_shape), dtype=SCALE_DTYPE,
                                                     pin_memory=self.cuda) for _ in range(2))
            self.scale_bytes = 2 * self.k_scale.numel() * SCALE_DTYPE.itemsize
        self.capacity_bytes = self.kv_bytes + self.scale_bytes
        """Bytes of the tier: keys, values and scales."""
        self._lock = threading.Condition()
        self._target = self._pinned = 0  # chunks asked for, chunks pinned
        self._ranges: list[tuple[int, int]] = []  # (address, bytes) registered, in order
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._demand = 0  # blocks below this are written or about to be (the largest reserve())
        self.ahead_blocks = self.chunk_blocks
        """Blocks :meth:`reserve` asks to have pinned beyond those written; doubled after each wait."""
        self.wait_s, self.num_waits = 0.0, 0
        if on_demand is None:
            on_demand = not self.cuda or registered_pointers_agree()
        self.eager = not on_demand
        """Pinned at once (one ``cudaHostAlloc`` each for keys and values), not chunk by chunk."""
        shape = (num_layers, num_blocks, *block_shape)
        if self.eager:
            logger.info("the host tier's %.2f GiB are pinned at once (cudaHostAlloc)", self.capacity_bytes / 2**30)
            self.k, self.v = (self._allocate_pinned(shape, dtype) for _ in range(2))
            self._pinned = self._target = self.num_chunks
            return
        try:
            self._map = mmap.mmap(-1, self.kv_bytes, flags=mmap.MAP_PRIVATE)
        except (OSError, ValueError) as err:
            raise RuntimeError(f"cannot map {self.kv_bytes / 2**30:.2f} GiB of host memory for the host tier "
                               f"{shape}: {err}") from err
        flat = torch.frombuffer(self._map, dtype=dtype)
        self.base = flat.data_ptr()
        inner = [math.prod(block_shape[i + 1:]) for i in range(len(block_shape))]  # a block, contiguous
        stride = (self.layer_stride // dtype.itemsize, block_elems, *inner)
        self.k, self.v = (flat.as_strided(shape, stride, t * num_layers * self.layer_stride // dtype.itemsize)
                          for t in range(2))

    def _allocate_pinned(self, shape, dtype) -> torch.Tensor:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as err:
            nbytes = math.prod(shape) * dtype.itemsize
            raise RuntimeError(f"cannot allocate pinned host KV cache of 2 x {nbytes / 2**30:.2f} GiB "
                               f"{tuple(shape)} (keys, values): {err}") from err

    # ---- chunks ------------------------------------------------------------------------
    @property
    def pinned_blocks(self) -> int:
        """Host blocks ``0 .. pinned_blocks - 1`` are pinned (all of them on the eager path)."""
        return min(self.num_blocks, self._pinned * self.chunk_blocks)

    @property
    def one_allocation(self) -> bool:
        """Whether keys (and values) are one pinned allocation, so that one copy may span
        layers; False on demand: each layer's range of a chunk is its own registration, and a
        copy must stay inside one (module doc)."""
        return self.eager

    @property
    def registration_blocks(self) -> int | None:
        """Host blocks per registration of one layer (a copy inside one must not cross a multiple of
        it); None when the memory is one allocation."""
        return None if self.one_allocation else self.chunk_blocks

    @property
    def bytes_pinned(self) -> int:
        """Bytes page-locked now (on CPU: that would be): keys and values pinned so far, and the
        scales (pinned at once, for the life of their tensors)."""
        return self.capacity_bytes if self.eager else sum(size for _, size in self._ranges) + self.scale_bytes

    def chunk_ranges(self, chunk: int) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the ranges that pin ``chunk`` (module doc), keys then values,
        layer by layer; each starts on a page."""
        first, last = chunk * self.chunk_blocks, min((chunk + 1) * self.chunk_blocks, self.num_blocks)
        ranges = []
        for layer in range(2 * self.num_layers):
            start = self.base + layer * self.layer_stride
            end = start + (self.layer_stride if last == self.num_blocks else last * self.block_bytes)
            ranges.append((start + first * self.block_bytes, end - start - first * self.block_bytes))
        return ranges

    def _pin(self, address: int, size: int):
        """Fault the range's pages in (CPU work, no driver call), register it in one call (a copy
        must not span two registrations, module doc), then pause (:data:`PIN_DUTY`) unless the
        pinned blocks end less than a chunk beyond those in use (module doc)."""
        if self.cuda:
            offset = address - self.base
            torch.frombuffer(self._map, dtype=torch.uint8, count=size, offset=offset).fill_(0)
        t = time.perf_counter()
        self._register(address, size)
        pause = (time.perf_counter() - t) * (1 / PIN_DUTY - 1)
        self._ranges.append((address, size))
        with self._lock:
            self._lock.wait_for(lambda: self._stop or self._close_to_use(), timeout=pause)

    def _close_to_use(self) -> bool:
        """Whether the pinned blocks end less than a chunk beyond the blocks in use (the thread does
        not pause then: a pause would soon make a step wait). Called with the lock held."""
        return self.pinned_blocks < min(self.num_blocks, self._demand + self.chunk_blocks)

    def _register(self, address: int, size: int):
        """Page-lock ``size`` bytes at ``address`` (CUDA: ``cudaHostRegister``; CPU: nothing)."""
        if self.cuda:
            register_host_range(address, size)

    # ---- growth ------------------------------------------------------------------------
    def start(self):
        """Start pinning in the background (the first chunk now; idempotent)."""
        with self._lock:
            if self._thread is None and not self.eager and not self._stop:
                self._thread = threading.Thread(target=self._run, name="nanovllm-host-pinning", daemon=True)
                self._thread.start()
        self.reserve(0)

    def pin_first_chunk(self):
        """Pin chunk 0 now, in the calling thread, before the thread starts (a no-op once it is
        pinned): CUDA graphs that gather host pages are captured before pinning starts (a
        registration during a capture would break it), and a kernel launch checks that the
        addresses it is given are registered; every layer's first block lies in chunk 0."""
        with self._lock:
            if self._pinned or self._thread is not None:
                return
        try:
            for address, size in self.chunk_ranges(0):
                self._pin(address, size)
        except RuntimeError as err:
            raise RuntimeError(f"cannot pin the host tier's first {self.chunk_blocks} blocks "
                               f"({self.bytes_pinned / 2**30:.2f} of {self.capacity_bytes / 2**30:.2f} GiB pinned): "
                               f"{err}; lower cpu_memory_utilization or num_cpu_kvcache_blocks") from err
        with self._lock:
            self._pinned = self._target = max(self._target, 1)

    def reserve(self, num_blocks: int):
        """Blocks below ``num_blocks`` are about to be written: ask for every chunk through block
        ``num_blocks + ahead_blocks``, without waiting."""
        want = min(self.num_chunks, -(-(num_blocks + self.ahead_blocks) // self.chunk_blocks))
        with self._lock:
            if num_blocks > self._demand:
                self._demand = num_blocks
                self._lock.notify_all()  # may end the thread's pause (_close_to_use)
            if want > self._target:
                self._target = want
                self._lock.notify_all()

    def ensure(self, num_blocks: int):
        """Blocks below ``num_blocks`` are pinned when this returns (waiting for the thread if it
        is behind, which is logged and doubles :attr:`ahead_blocks`); also :meth:`reserve`.

        Raises:
            RuntimeError: pinning failed (CUDA's error, the bytes pinned and the capacity).
        """
        if self._thread is None:
            self.start()
        self.reserve(num_blocks)
        if self.pinned_blocks >= num_blocks and self._error is None:
            return
        t = time.perf_counter()
        with self._lock:  # reserve() made the blocks in use reach past the pinned ones: no pause now
            while self.pinned_blocks < num_blocks and self._error is None and not self._stop:
                self._lock.wait()
        if self._error is not None:
            raise RuntimeError(f"cannot pin host memory for the host tier ({self.bytes_pinned / 2**30:.2f} of "
                               f"{self.capacity_bytes / 2**30:.2f} GiB pinned): {self._error}; lower "
                               f"cpu_memory_utilization or num_cpu_kvcache_blocks") from self._error
        waited = time.perf_counter() - t
        self.wait_s += waited
        self.num_waits += 1
        self.ahead_blocks = min(self.num_blocks, 2 * self.ahead_blocks)
        self.reserve(num_blocks)
        logger.warning("a step waited %.3f s for host memory to be pinned (blocks below %d of %d); %.2f GiB pinned; "
                       "pinning %d blocks ahead from now", waited, num_blocks, self.num_blocks,
                       self.bytes_pinned / 2**30, self.ahead_blocks)

    def _run(self):
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)  # the registering context is this device's
            while True:
                with self._lock:
                    while not self._stop and self._pinned >= self._target:
                        self._lock.wait()
                    if self._stop:
                        return
                    chunk = self._pinned
                for address, size in self.chunk_ranges(chunk):
                    self._pin(address, size)
                if self._stop:
                    return
                with self._lock:
                    self._pinned += 1
                    self._lock.notify_all()
        except BaseException as err:  # reported by the next ensure()
            with self._lock:
                self._error = err
                self._lock.notify_all()

    def release(self):
        """Stop pinning and unregister every range (the device must be done with the memory:
        the CUDA device is synchronized first); the tensors stay valid, pageable."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self.cuda and self._ranges:
            torch.cuda.synchronize(self.device)
            for address, _ in self._ranges:
                unregister_host_range(address)
        self._ranges = []
        self._pinned = self._target = 0

"""Strided ("scatter/gather") copies between host and device: ``memcpy_2d_async``.

The offload engine keeps the KV cache in pinned host memory, layer-major
``[num_layers, num_blocks, block_bytes]``, and stages blocks through GPU buffers
``[num_layers, block_bytes]``. Moving one block of every layer is one 2D copy of ``height =
num_layers`` rows of ``width = block_bytes`` bytes whose rows lie ``num_blocks * block_bytes``
bytes apart on the host and ``block_bytes`` apart on the GPU. ``cudaMemcpy2DAsync`` moves such a
region in one call on the copy engine (``csrc/sgdma.cpp``); its rate against torch's strided and
row-by-row copies: docs/benchmarks.md, 'Host <-> device copies'.

Backends, picked once on first use with CUDA tensors (``backend()`` says which):

- ``"extension"``: the module ``nanovllm._sgdma`` that ``setup.py`` builds from ``csrc/sgdma.cpp``
  when a CUDA toolkit and CUDA torch are present at install time;
- ``"jit"``: the same source compiled with ``torch.utils.cpp_extension.load`` on first use (cached
  in torch's extensions folder, ``TORCH_EXTENSIONS_DIR``; the first use waits for the build:
  docs/kvcache.md, 'Measured');
- ``"torch"``: a fallback that moves exactly the same bytes with torch copies of uint8 views, one
  contiguous copy per row between devices (a single strided copy within one device). It is used
  for CPU-only copies always, and for everything when neither build is available.
"""
from __future__ import annotations

import logging
import operator
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["memcpy_2d_async", "memcpy_2d_moves_async", "memcpy_2d_torch", "backend", "load_error"]

KINDS = ("h2d", "d2h", "d2d", "h2h", "default")
_CSRC = Path(__file__).resolve().parents[2] / "csrc" / "sgdma.cpp"
_JIT_NAME = "nanovllm_sgdma"

_lock = threading.Lock()
_module = None  # the loaded extension module, once resolved
_backend: str | None = None  # "extension" | "jit" | "torch", once resolved
_load_error: str | None = None  # why the accelerated backends are unavailable, when they are


def _jit_build(errors: list[str]):
    """The extension built from ``csrc/sgdma.cpp`` with torch's JIT loader, or None with the reason
    appended to ``errors`` (no CUDA, no source, a failed build)."""
    if not torch.cuda.is_available():
        errors.append("torch.cuda is not available")
        return None
    if not _CSRC.is_file():
        errors.append(f"source {_CSRC} not found")
        return None
    try:
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        module = load(name=_JIT_NAME, sources=[str(_CSRC)], with_cuda=True, extra_cflags=["-O2"], verbose=False)
    except Exception as e:  # compiler missing, headers missing, link errors, ...
        errors.append(f"JIT build of {_CSRC.name} failed: {type(e).__name__}: {e}")
        logger.warning("sgdma: %s; strided copies fall back to row-by-row torch copies (much slower)", errors[-1])
        return None
    logger.info("sgdma: built/loaded the %s extension with torch.utils.cpp_extension in %.1f s",
                _JIT_NAME, time.perf_counter() - start)
    return module


def _resolve() -> str:
    """Pick the backend once: prebuilt extension, else JIT build (needs CUDA), else torch."""
    global _module, _backend, _load_error
    if _backend is not None:
        return _backend
    with _lock:
        if _backend is not None:
            return _backend
        errors = []
        try:
            from nanovllm import _sgdma  # built by setup.py

            _module, _backend = _sgdma, "extension"
        except ImportError as e:
            errors.append(f"no prebuilt nanovllm._sgdma ({e})")
            _module = _jit_build(errors)
            _load_error = "; ".join(errors) if _module is None else None
            _backend = "torch" if _module is None else "jit"  # last: other threads read it unlocked
        return _backend


def backend() -> str:
    """The backend CUDA copies use: ``"extension"`` (prebuilt ``nanovllm._sgdma``), ``"jit"``
    (compiled on first use) or ``"torch"`` (fallback). Resolving it may compile the extension
    once (when CUDA is available and no prebuilt module exists)."""
    return _resolve()


def load_error() -> str | None:
    """Why CUDA copies fall back to torch (the reasons the extension and the JIT build were not
    available), or None when they go through ``cudaMemcpy2DAsync``. Resolves the backend as
    :func:`backend` does."""
    return None if _resolve() != "torch" else _load_error


def _int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _check_region(name: str, t: torch.Tensor, pitch: int, width: int, height: int) -> None:
    nbytes = t.untyped_storage().nbytes()
    offset = t.storage_offset() * t.element_size()
    end = offset + (height - 1) * pitch + width
    if end > nbytes:
        raise ValueError(
            f"sgdma: the 2D region of {name} (byte offset {offset} + (height {height} - 1) * pitch "
            f"{pitch} + width {width} = {end} bytes) goes beyond its storage of {nbytes} bytes")


def _check_args(dst, src, dpitch, spitch, width, height, kind, stream):
    if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
        raise TypeError(f"sgdma: dst and src must be tensors, got {type(dst).__name__} and "
                        f"{type(src).__name__}")
    dpitch, spitch = _int("dpitch", dpitch), _int("spitch", spitch)
    width, height = _int("width", width), _int("height", height)
    if width <= 0:
        raise ValueError(f"sgdma: width must be > 0 bytes, got {width}")
    if height <= 0:
        raise ValueError(f"sgdma: height must be > 0 rows, got {height}")
    if width > dpitch:
        raise ValueError(f"sgdma: width {width} bytes exceeds dpitch {dpitch} bytes")
    if width > spitch:
        raise ValueError(f"sgdma: width {width} bytes exceeds spitch {spitch} bytes")
    if kind not in KINDS:
        raise ValueError(f"sgdma: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    for name, t in (("dst", dst), ("src", src)):
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"sgdma: {name} must be on the CPU or a CUDA device, got {t.device}")
    want = {"h2d": ("cuda", "cpu"), "d2h": ("cpu", "cuda"), "d2d": ("cuda", "cuda"),
            "h2h": ("cpu", "cpu")}.get(kind)
    if want is not None:
        for name, t, dev in (("dst", dst, want[0]), ("src", src, want[1])):
            if t.device.type != dev:
                raise ValueError(f"sgdma: kind {kind!r} needs {name} on "
                                 f"{'a CUDA device' if dev == 'cuda' else 'the CPU'}, got {t.device}")
    if dst.device.type != src.device.type:  # host <-> device: the host side must be pinned
        name, host = ("src", src) if dst.is_cuda else ("dst", dst)
        if not host.is_pinned():
            raise ValueError(f"sgdma: {name} is the host tensor of a {kind!r} copy but is not in "
                             "pinned (page-locked) memory; allocate it with pin_memory=True")
    _check_region("dst", dst, dpitch, width, height)
    _check_region("src", src, spitch, width, height)
    if stream is not None:
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"sgdma: stream must be a torch.cuda.Stream or None, got "
                            f"{type(stream).__name__}")
        cuda_dev = dst.device if dst.is_cuda else (src.device if src.is_cuda else None)
        if cuda_dev is not None and stream.device != cuda_dev:
            raise ValueError(f"sgdma: stream is on {stream.device} but the copy's CUDA tensor is "
                             f"on {cuda_dev}")
    return dpitch, spitch, width, height


def _byte_rows(t: torch.Tensor, pitch: int, width: int, height: int) -> torch.Tensor:
    """A uint8 view ``[height, width]`` with row stride ``pitch`` starting at ``t.data_ptr()``."""
    view = torch.empty(0, dtype=torch.uint8, device=t.device)
    return view.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (height, width),
                     (pitch, 1))


def memcpy_2d_torch(dst: torch.Tensor, src: torch.Tensor, dpitch: int, spitch: int, width: int, height: int,
                    stream: torch.cuda.Stream | None = None) -> None:
    """The ``"torch"`` backend of :func:`memcpy_2d_async` (module doc): the same bytes through torch
    copies of uint8 views, one contiguous copy per row between devices, a single strided copy
    within one device. Arguments as :func:`memcpy_2d_async`'s, not checked (it is the fallback
    behind those checks, and the reference the copy engine is compared with)."""
    with torch.no_grad():
        d = _byte_rows(dst, dpitch, width, height)
        s = _byte_rows(src, spitch, width, height)
        if dst.device == src.device:  # one strided copy (a kernel on the GPU, memcpy on the CPU)
            rows = [(d, s)]
        else:  # host <-> device or across GPUs: each row one contiguous DMA
            rows = [(d[r], s[r]) for r in range(height)]
        if stream is None or not (dst.is_cuda or src.is_cuda):
            for a, b in rows:
                a.copy_(b, non_blocking=True)
        else:
            with torch.cuda.stream(stream):
                for a, b in rows:
                    a.copy_(b, non_blocking=True)


def memcpy_2d_async(dst: torch.Tensor, src: torch.Tensor, dpitch: int, spitch: int, width: int,
                    height: int, kind: str, stream: torch.cuda.Stream | None = None) -> None:
    """Copy ``height`` rows of ``width`` bytes from ``src`` to ``dst`` (``cudaMemcpy2DAsync``).

    Row ``r`` is the ``width`` bytes at byte ``r * spitch`` after ``src.data_ptr()``, written to
    byte ``r * dpitch`` after ``dst.data_ptr()``. The tensors' dtypes, shapes and strides do not
    matter beyond where ``data_ptr()`` points; the region is counted in bytes of their storage.

    Args:
        dst, src: tensors whose ``data_ptr()`` is the first byte of the 2D region (e.g.
            ``host_cache[0, block]`` of a ``[num_layers, num_blocks, ...]`` host cache).
        dpitch, spitch: bytes between the starts of consecutive rows in ``dst`` / ``src``.
        width: bytes per row, ``0 < width <= min(dpitch, spitch)``.
        height: number of rows, ``> 0``.
        kind: ``"h2d"`` (src pinned CPU -> dst CUDA), ``"d2h"`` (CUDA -> pinned CPU), ``"d2d"``,
            ``"h2h"``, or ``"default"`` (direction inferred from the devices, cudaMemcpyDefault).
        stream: the ``torch.cuda.Stream`` to queue the copy on; ``None`` = the current stream of
            the CUDA tensor's device. Ignored for CPU-only copies, which complete before returning.

    The copy is asynchronous with respect to the host when a GPU is involved: keep both tensors
    alive and synchronize ``stream`` (or wait on an event recorded on it) before reading ``dst``
    or overwriting ``src``; tensors allocated on another stream need ``record_stream``. The
    regions must not overlap.

    Raises:
        ValueError: ``width`` or ``height`` not positive; ``width`` larger than ``dpitch`` or
            ``spitch``; the region ``offset + (height - 1) * pitch + width`` beyond a tensor's
            storage (the message gives the numbers); ``kind`` unknown or not matching the
            tensors' devices; the host tensor of a host<->device copy not pinned; ``stream`` on
            another device.
        TypeError: non-integer sizes, non-tensor arguments, a ``stream`` that is no
            ``torch.cuda.Stream``.
        RuntimeError: a CUDA error (with ``cudaGetErrorString``'s text).
    """
    dpitch, spitch, width, height = _check_args(dst, src, dpitch, spitch, width, height, kind,
                                                stream)
    if not (dst.is_cuda or src.is_cuda) or _resolve() == "torch":
        memcpy_2d_torch(dst, src, dpitch, spitch, width, height, stream)
        return
    if stream is None:
        _module.memcpy_2d_async(dst, src, dpitch, spitch, width, height, kind, 0)
    elif stream.cuda_stream == 0:
        # The extension reads handle 0 as "the current stream"; make the legacy default stream
        # current for this call so that an explicitly requested default stream is honoured.
        with torch.cuda.stream(stream):
            _module.memcpy_2d_async(dst, src, dpitch, spitch, width, height, kind, 0)
    else:
        _module.memcpy_2d_async(dst, src, dpitch, spitch, width, height, kind, stream.cuda_stream)


def _bytes_from(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A uint8 view of ``t``'s storage from byte ``offset`` after ``t.data_ptr()`` to its end."""
    start = t.storage_offset() * t.element_size() + offset
    nbytes = t.untyped_storage().nbytes()
    if not 0 <= start <= nbytes:
        raise ValueError(f"sgdma: byte offset {offset} from a tensor at storage byte {start - offset} is outside its "
                         f"storage of {nbytes} bytes")
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), start, (nbytes - start,), (1,))


def memcpy_2d_moves_async(device: torch.Tensor, host: torch.Tensor, device_offsets: list[int], host_offsets: list[int],
                          to_host: list[bool], device_pitch: int, host_pitch: int, width: int, height: int,
                          stream: torch.cuda.Stream | None = None) -> None:
    """Block moves between ``device`` and ``host``, in order: move ``i`` copies ``height`` rows of
    ``width`` bytes between byte ``device_offsets[i]`` after ``device.data_ptr()`` (rows
    ``device_pitch`` bytes apart) and byte ``host_offsets[i]`` after ``host.data_ptr()`` (rows
    ``host_pitch`` apart), to the host where ``to_host[i]``, else to the device.

    A step's block moves in one call: with a CUDA ``device`` and the extension, the arguments are
    checked here as :func:`memcpy_2d_async` checks them (for the lowest and the highest offsets,
    which bound every move's regions) and one C++ call issues a ``cudaMemcpy2DAsync`` per move
    (checking that each host region's first byte is pinned); otherwise (a CPU ``device``, or the
    torch backend) each move is a :func:`memcpy_2d_async`.

    Args:
        device: the GPU side (a CPU tensor on CPU-only engines); host: the host side (pinned, at
            least where the moves touch it, for a CUDA ``device``).
        device_offsets, host_offsets: byte offsets from the tensors' ``data_ptr()``, one per move.
        to_host: the direction of each move.
        device_pitch, host_pitch, width, height: as :func:`memcpy_2d_async`'s, for every move.
        stream: as :func:`memcpy_2d_async`'s.

    Raises:
        ValueError: lists of different lengths; a region beyond its tensor's storage; a width,
            height or pitch :func:`memcpy_2d_async` refuses; a host region not pinned (CUDA).
        RuntimeError: a CUDA error.
    """
    n = len(device_offsets)
    if len(host_offsets) != n or len(to_host) != n:
        raise ValueError(f"sgdma: {n} device_offsets, {len(host_offsets)} host_offsets and {len(to_host)} to_host "
                         "flags: one each per move")
    if not n:
        return
    if device.is_cuda and _resolve() != "torch":
        # every move's regions have one shape: the lowest offsets start first, the highest end last
        for t, offsets in ((device, device_offsets), (host, host_offsets)):
            _bytes_from(t, min(offsets))
        _check_args(_bytes_from(device, max(device_offsets)), _bytes_from(host, max(host_offsets)), device_pitch,
                    host_pitch, width, height, "h2d", stream)
        offsets = torch.tensor([device_offsets, host_offsets], dtype=torch.int64)
        args = (device, host, offsets[0], offsets[1], torch.tensor(to_host, dtype=torch.bool), device_pitch,
                host_pitch, width, height)
        if stream is not None and stream.cuda_stream == 0:
            with torch.cuda.stream(stream):  # the extension reads handle 0 as the current stream
                _module.memcpy_2d_moves_async(*args, 0)
        else:
            _module.memcpy_2d_moves_async(*args, 0 if stream is None else stream.cuda_stream)
        return
    cross = device.is_cuda
    for d, h, up in zip(device_offsets, host_offsets, to_host):
        dv, hv = _bytes_from(device, d), _bytes_from(host, h)
        if up:
            memcpy_2d_async(hv, dv, host_pitch, device_pitch, width, height, "d2h" if cross else "h2h", stream)
        else:
            memcpy_2d_async(dv, hv, device_pitch, host_pitch, width, height, "h2d" if cross else "h2h", stream)

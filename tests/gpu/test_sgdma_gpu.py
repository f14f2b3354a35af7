"""CUDA tests of nanovllm.kvcache.memcpy2d: the cudaMemcpy2DAsync path (prebuilt or JIT extension) moves
the same bytes as the torch fallback, H2D and D2H, on the stream it is given.

Run on the GPU machine: python -m pytest tests/gpu/test_sgdma_gpu.py -q -m gpu
"""
import pytest
import torch

from nanovllm.kvcache import memcpy2d as sgdma
from nanovllm.kvcache.memcpy2d import memcpy_2d_async, memcpy_2d_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

L, NB, BLOCK, H, D = 8, 6, 64, 8, 128  # host cache [L, NB, BLOCK, H, D] bf16: 128 KiB per layer-block
DT = torch.bfloat16
BLOCK_BYTES = BLOCK * H * D * 2


def _host_cache(seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (L, NB, BLOCK, H, D * 2), generator=g, dtype=torch.uint8)
    return raw.view(DT).pin_memory()


def _gpu_buffer(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    raw = torch.randint(0, 256, (L, BLOCK, H, D * 2), generator=g, dtype=torch.uint8, device="cuda")
    return raw.view(DT)


def _bytes(t):
    return t.contiguous().view(torch.uint8).cpu()


def test_the_accelerated_backend_is_used():
    assert sgdma.backend() != "torch", f"fell back to torch: {sgdma.load_error()}"
    assert sgdma.load_error() is None


@pytest.mark.parametrize("block", [0, 3, NB - 1])
def test_h2d_load_matches_fallback_on_a_side_stream(block):
    host = _host_cache(seed=block)
    ext_buf, ref_buf = _gpu_buffer(1), _gpu_buffer(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the buffers were written on the current stream
    args = (BLOCK_BYTES, NB * BLOCK_BYTES, BLOCK_BYTES, L)
    memcpy_2d_async(ext_buf, host[0, block], *args, "h2d", stream=stream)
    memcpy_2d_torch(ref_buf, host[0, block], *args, stream=stream)
    stream.synchronize()
    assert torch.equal(_bytes(ext_buf), _bytes(ref_buf))
    assert torch.equal(_bytes(ext_buf), _bytes(host[:, block]))


@pytest.mark.parametrize("block", [0, 2, NB - 1])
def test_d2h_offload_matches_fallback_on_a_side_stream(block):
    ext_host, ref_host = _host_cache(seed=7), _host_cache(seed=7)
    buf = _gpu_buffer(seed=10 + block)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    args = (NB * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES, L)
    memcpy_2d_async(ext_host[0, block], buf, *args, "d2h", stream=stream)
    memcpy_2d_torch(ref_host[0, block], buf, *args, stream=stream)
    stream.synchronize()
    assert torch.equal(ext_host.view(torch.uint8), ref_host.view(torch.uint8))
    assert torch.equal(ext_host[:, block].view(torch.uint8), _bytes(buf))


def test_copy_is_ordered_on_the_given_stream():
    """A D2H copy queued after a long kernel on the same stream sees that kernel's writes."""
    buf = torch.zeros(L, BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    host = torch.zeros(L, NB, BLOCK_BYTES, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the fill
        buf.fill_(0xAB)
    memcpy_2d_async(host[0, 1], buf, NB * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES, L, "d2h", stream=stream)
    stream.synchronize()
    assert host[:, 1].eq(0xAB).all() and host[:, 0].eq(0).all() and host[:, 2:].eq(0).all()


@pytest.mark.parametrize("which", ["current", "default"])
def test_stream_none_uses_the_current_stream_and_default_stream_is_honoured(which):
    """The copy must be queued behind a slow fill on the stream it is meant for."""
    buf = torch.zeros(L, BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    host = torch.zeros(L, NB, BLOCK_BYTES, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    args = (NB * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES, L, "d2h")
    if which == "current":
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            buf.fill_(0x5A)
            memcpy_2d_async(host[0, 3], buf, *args)  # stream=None: the current stream, `side`
    else:
        default = torch.cuda.default_stream()
        with torch.cuda.stream(default):
            torch.cuda._sleep(50_000_000)
            buf.fill_(0x5A)
        with torch.cuda.stream(side):  # the current stream is `side`, but we ask for the default
            memcpy_2d_async(host[0, 3], buf, *args, stream=default)
    torch.cuda.synchronize()
    assert host[:, 3].eq(0x5A).all() and host[:, :3].eq(0).all() and host[:, 4:].eq(0).all()


def test_d2d_and_default_kind():
    src = _gpu_buffer(seed=5)
    dst = torch.zeros(L, 2, BLOCK, H, D, dtype=DT, device="cuda")
    memcpy_2d_async(dst[0, 1], src, 2 * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES, L, "d2d")
    host = torch.zeros(L, 3, BLOCK, H, D, dtype=DT).pin_memory()
    memcpy_2d_async(host[0, 2], src, 3 * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES, L, "default")
    torch.cuda.synchronize()
    assert torch.equal(_bytes(dst[:, 1]), _bytes(src)) and dst[:, 0].eq(0).all()
    assert torch.equal(_bytes(host[:, 2]), _bytes(src)) and host[:, :2].eq(0).all()


def test_pitch_above_cuda_max_pitch_is_copied_row_by_row():
    """cudaMemcpy2D* rejects pitches above cudaDevAttrMaxPitch (2^31 - 1); a host cache of
    more than 2 GiB per layer has such a pitch. The extension then issues one copy per row."""
    pitch = (1 << 31) + 4096
    rows, width = 2, 4096
    host = torch.empty(pitch + width, dtype=torch.uint8, pin_memory=True)
    host[:width].fill_(1)
    host[pitch:].fill_(2)
    buf = torch.zeros(rows, width, dtype=torch.uint8, device="cuda")
    memcpy_2d_async(buf, host, width, pitch, width, rows, "h2d")
    torch.cuda.synchronize()
    assert buf[0].eq(1).all() and buf[1].eq(2).all()
    buf.fill_(9)
    memcpy_2d_async(host, buf, pitch, width, width, rows, "d2h")
    torch.cuda.synchronize()
    assert host[:width].eq(9).all() and host[pitch:].eq(9).all()
    # a single row: the pitches do not matter, however large
    buf.zero_()
    memcpy_2d_async(buf[1], host[pitch:], 1 << 40, 1 << 40, width, 1, "h2d")
    torch.cuda.synchronize()
    assert buf[1].eq(9).all() and buf[0].eq(0).all()


def test_pageable_host_memory_and_device_mismatches_are_rejected():
    buf = torch.zeros(L, BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    pageable = torch.zeros(L, NB, BLOCK_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pinned"):
        memcpy_2d_async(buf, pageable[0, 1], BLOCK_BYTES, NB * BLOCK_BYTES, BLOCK_BYTES, L, "h2d")
    with pytest.raises(ValueError, match="pinned"):
        memcpy_2d_async(pageable[0, 1], buf, NB * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES, L, "d2h")
    pinned = pageable.pin_memory()
    with pytest.raises(ValueError, match="'h2d' needs dst on a CUDA device"):
        memcpy_2d_async(pinned[0, 1], buf, NB * BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES, L, "h2d")
    with pytest.raises(ValueError, match="beyond its storage"):
        memcpy_2d_async(buf, pinned[0, 1], BLOCK_BYTES, NB * BLOCK_BYTES, BLOCK_BYTES, L + 1, "h2d")


def test_moves_in_one_call_keep_their_order_and_match_the_fallback():
    """memcpy_2d_moves_async through the extension: write-backs and load-backs of [L, N] block
    caches in one call, in order (a load-back reads a block a write-back of the call wrote; a
    write-back reads a block a load-back wrote), equal to the torch fallback's moves."""
    moves = [(0, 2, True), (1, 3, True), (3, 2, False), (4, 3, False), (3, 5, True)]  # (gpu, host, to_host)
    results = []
    for accelerated in (True, False):
        host = _host_cache(seed=3)
        g = torch.Generator(device="cuda").manual_seed(4)
        gpu = torch.randint(0, 256, (L, 5, BLOCK, H, D * 2), generator=g, dtype=torch.uint8, device="cuda").view(DT)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        args = ([m[0] * BLOCK_BYTES for m in moves], [m[1] * BLOCK_BYTES for m in moves], [m[2] for m in moves],
                5 * BLOCK_BYTES, NB * BLOCK_BYTES, BLOCK_BYTES, L)
        if accelerated:
            sgdma.memcpy_2d_moves_async(gpu, host, *args, stream=stream)
        else:
            for d, h, up in zip(*args[:3]):
                dv, hv = sgdma._bytes_from(gpu, d), sgdma._bytes_from(host, h)
                src, dst, sp, dp = (dv, hv, args[3], args[4]) if up else (hv, dv, args[4], args[3])
                memcpy_2d_torch(dst, src, dp, sp, BLOCK_BYTES, L, stream=stream)
        stream.synchronize()
        results.append((_bytes(gpu), _bytes(host)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    gpu, host = results[0]
    assert torch.equal(host[:, 5], host[:, 2]) and torch.equal(gpu[:, 3], gpu[:, 0])


def test_moves_refuse_an_unpinned_host_region_and_a_region_past_the_storage():
    gpu = torch.zeros(L, 2, BLOCK, H, D, dtype=DT, device="cuda")
    pageable = torch.zeros(L, NB, BLOCK, H, D, dtype=DT)
    with pytest.raises(ValueError, match="pinned"):
        sgdma.memcpy_2d_moves_async(gpu, pageable, [0], [0], [False], 2 * BLOCK_BYTES, NB * BLOCK_BYTES,
                                    BLOCK_BYTES, L)
    with pytest.raises(ValueError, match="beyond its storage"):
        sgdma.memcpy_2d_moves_async(gpu, _host_cache(seed=0), [2 * BLOCK_BYTES], [0], [False], 2 * BLOCK_BYTES,
                                    NB * BLOCK_BYTES, BLOCK_BYTES, L)

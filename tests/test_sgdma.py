"""CPU tests of nanovllm.kvcache.memcpy2d.memcpy_2d_async (the torch fallback that CPU-only copies use):
layer-strided layouts of the offload engine in both directions, byte-exact against a numpy
reference, and argument errors that name the numbers."""
import ctypes

import numpy as np
import pytest
import torch

from nanovllm.kvcache import memcpy2d as sgdma
from nanovllm.kvcache.memcpy2d import memcpy_2d_async, memcpy_2d_moves_async


def _random_bytes(shape, seed, dtype=torch.uint8):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape[:-1] + (shape[-1] * torch.empty(0, dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """A copy of every byte of ``t``'s storage."""
    storage = t.untyped_storage()
    return np.frombuffer(ctypes.string_at(storage.data_ptr(), storage.nbytes()), dtype=np.uint8).copy()


def _reference(dst, src, dpitch, spitch, width, height) -> np.ndarray:
    """What dst's storage must hold after the copy."""
    out = _storage_bytes(dst)
    inp = _storage_bytes(src)
    d0 = dst.storage_offset() * dst.element_size()
    s0 = src.storage_offset() * src.element_size()
    for r in range(height):
        out[d0 + r * dpitch : d0 + r * dpitch + width] = inp[s0 + r * spitch : s0 + r * spitch + width]
    return out


# Offload layouts: host cache [num_layers, num_blocks, block_size, kv_heads, head_dim] layer-major,
# GPU-side buffer [num_layers, block_size, kv_heads, head_dim].
LAYOUTS = [
    dict(num_layers=4, num_blocks=5, block_size=16, kv_heads=2, head_dim=8, dtype=torch.bfloat16),
    dict(num_layers=3, num_blocks=7, block_size=8, kv_heads=1, head_dim=32, dtype=torch.float32),
    dict(num_layers=32, num_blocks=3, block_size=4, kv_heads=8, head_dim=16, dtype=torch.float16),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"L{l['num_layers']}B{l['num_blocks']}")
def test_load_block_from_layer_major_host_cache(layout):
    L, NB, bs, H, D, dt = (layout[k] for k in ("num_layers", "num_blocks", "block_size", "kv_heads",
                                                 "head_dim", "dtype"))
    host = _random_bytes((L, NB, bs, H, D), seed=0, dtype=dt)
    block_bytes = bs * H * D * host.element_size()
    for block in range(NB):
        buf = _random_bytes((L, bs, H, D), seed=100 + block, dtype=dt)
        expected = _reference(buf, host[0, block], block_bytes, NB * block_bytes, block_bytes, L)
        memcpy_2d_async(buf, host[0, block], dpitch=block_bytes, spitch=NB * block_bytes,
                        width=block_bytes, height=L, kind="h2h")
        assert np.array_equal(_storage_bytes(buf), expected)
        assert torch.equal(buf.view(torch.uint8), host[:, block].view(torch.uint8))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"L{l['num_layers']}B{l['num_blocks']}")
def test_offload_block_to_layer_major_host_cache(layout):
    L, NB, bs, H, D, dt = (layout[k] for k in ("num_layers", "num_blocks", "block_size", "kv_heads",
                                                 "head_dim", "dtype"))
    host = _random_bytes((L, NB, bs, H, D), seed=1, dtype=dt)
    block_bytes = bs * H * D * host.element_size()
    for block in reversed(range(NB)):
        buf = _random_bytes((L, bs, H, D), seed=200 + block, dtype=dt)
        expected = _reference(host[0, block], buf, NB * block_bytes, block_bytes, block_bytes, L)
        before = host.clone()
        memcpy_2d_async(host[0, block], buf, dpitch=NB * block_bytes, spitch=block_bytes,
                        width=block_bytes, height=L, kind="h2h")
        assert np.array_equal(_storage_bytes(host), expected)
        # the block of every layer now holds the buffer; every other block is untouched
        assert torch.equal(host[:, block].view(torch.uint8), buf.view(torch.uint8))
        others = [b for b in range(NB) if b != block]
        assert torch.equal(host[:, others].view(torch.uint8), before[:, others].view(torch.uint8))


def test_round_trip_restores_the_block():
    L, NB, block_bytes = 6, 4, 96
    host = _random_bytes((L, NB, block_bytes), seed=2)
    original = host.clone()
    buf = torch.zeros(L, block_bytes, dtype=torch.uint8)
    memcpy_2d_async(buf, host[0, 2], block_bytes, NB * block_bytes, block_bytes, L, "h2h")
    host[:, 2].zero_()
    memcpy_2d_async(host[0, 2], buf, NB * block_bytes, block_bytes, block_bytes, L, "default")
    assert torch.equal(host, original)


@pytest.mark.parametrize("seed", range(8))
def test_random_pitches_widths_offsets_and_dtypes(seed):
    """Partial rows, unequal pitches, storage offsets, mixed dtypes: exactly the 2D region moves."""
    rng = np.random.default_rng(seed)
    height = int(rng.integers(1, 9))
    width = int(rng.integers(1, 64))
    dpitch = width + int(rng.integers(0, 40))
    spitch = width + int(rng.integers(0, 40))
    d_off, s_off = int(rng.integers(0, 16)), int(rng.integers(0, 16))
    dst_base = _random_bytes((d_off + (height - 1) * dpitch + width + int(rng.integers(0, 8)),), seed=seed)
    src_base = _random_bytes((s_off * 4 + (height - 1) * spitch + width + 4,), seed=1000 + seed)
    src_f32 = src_base[: (src_base.numel() // 4) * 4].view(torch.float32)  # a different dtype
    dst, src = dst_base[d_off:], src_f32[s_off:]
    expected = _reference(dst, src, dpitch, spitch, width, height)
    memcpy_2d_async(dst, src, dpitch, spitch, width, height, "h2h")
    assert np.array_equal(_storage_bytes(dst), expected)


def test_region_ending_exactly_at_the_storage_end_is_allowed():
    t = torch.arange(40, dtype=torch.uint8)
    out = torch.zeros(40, dtype=torch.uint8)
    memcpy_2d_async(out[30:], t[30:], dpitch=4, spitch=4, width=2, height=3, kind="h2h")  # 30..39
    assert out[30:].tolist() == [30, 31, 0, 0, 34, 35, 0, 0, 38, 39]


def test_tensors_that_require_grad_and_inference_tensors():
    src = torch.randn(4, 8, requires_grad=True)
    dst = torch.zeros(4, 8)
    memcpy_2d_async(dst, src, 32, 32, 32, 4, "h2h")
    assert torch.equal(dst, src.detach())
    with torch.inference_mode():
        a, b = torch.randn(3, 5), torch.zeros(3, 5)
    memcpy_2d_async(b, a, 20, 20, 20, 3, "h2h")
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(width=0), ["width", "0"]),
        (dict(width=-8), ["width", "-8"]),
        (dict(height=0), ["height", "0"]),
        (dict(height=-1), ["height", "-1"]),
        (dict(width=65, dpitch=64, spitch=128), ["width 65", "dpitch 64"]),
        (dict(width=65, dpitch=128, spitch=64), ["width 65", "spitch 64"]),
        (dict(height=5), ["dst", "320", "256"]),  # (5-1)*64+64 = 320 > 4*64 bytes of dst
        (dict(spitch=128, dpitch=64), ["src", "448", "256"]),  # 3*128+64 = 448 > 256
        (dict(kind="sideways"), ["kind", "sideways"]),
        (dict(kind="h2d"), ["h2d", "dst", "cpu"]),
        (dict(kind="d2h"), ["d2h", "src", "cpu"]),
        (dict(kind="d2d"), ["d2d", "cpu"]),
    ],
)
def test_bad_arguments_raise_value_error_with_the_numbers(kwargs, words):
    dst = torch.zeros(4, 64, dtype=torch.uint8)
    src = torch.ones(4, 64, dtype=torch.uint8)
    args = dict(dpitch=64, spitch=64, width=64, height=4, kind="h2h")
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        memcpy_2d_async(dst, src, **args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert torch.equal(dst, torch.zeros_like(dst))  # nothing was written


def test_region_beyond_storage_counts_the_view_offset():
    host = torch.zeros(4, 3, 16, dtype=torch.uint8)
    buf = torch.ones(4, 16, dtype=torch.uint8)
    # from block 2 of a [4, 3, 16] cache, 4 rows of pitch 48 end at 32 + 3*48 + 16 = 192 = the storage
    memcpy_2d_async(host[0, 2], buf, 48, 16, 16, 4, "h2h")
    assert host[:, 2].eq(1).all() and host[:, :2].eq(0).all()
    with pytest.raises(ValueError, match=r"byte offset 32 .* = 240 bytes\) goes beyond its storage of 192"):
        memcpy_2d_async(host[0, 2], buf, 48, 16, 16, 5, "h2h")


def test_non_integer_sizes_raise_type_error():
    t = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(TypeError, match="width"):
        memcpy_2d_async(t, t.clone(), 16, 16, 8.0, 1, "h2h")
    with pytest.raises(TypeError, match="dst and src"):
        memcpy_2d_async(t.numpy(), t, 16, 16, 8, 1, "h2h")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only backend choice")
def test_moves_copy_in_order_between_two_block_caches():
    """memcpy_2d_moves_async (CPU: one memcpy_2d_async per move, in order): blocks of every layer
    of a [L, N, ...] cache moved both ways, a later move reading what an earlier one wrote."""
    L, N, E = 3, 4, 5
    gpu = torch.arange(L * N * E, dtype=torch.float32).view(L, N, E)
    host = -torch.arange(L * 6 * E, dtype=torch.float32).view(L, 6, E)
    gpu0, host0 = gpu.clone(), host.clone()
    es = 4
    moves = [(1, 2, True), (2, 2, False), (2, 5, True)]  # (gpu block, host block, to_host)
    memcpy_2d_moves_async(gpu, host, [g * E * es for g, _, _ in moves], [h * E * es for _, h, _ in moves],
                          [up for *_, up in moves], N * E * es, 6 * E * es, E * es, L)
    assert torch.equal(host[:, 2], gpu0[:, 1]) and torch.equal(gpu[:, 2], gpu0[:, 1])
    assert torch.equal(host[:, 5], gpu0[:, 1]), "the last move read what the second wrote"
    assert torch.equal(host[:, [0, 1, 3, 4]], host0[:, [0, 1, 3, 4]]) and torch.equal(gpu[:, [0, 1, 3]], gpu0[:, [0, 1, 3]])


def test_moves_refuse_lists_of_different_lengths_and_regions_past_the_storage():
    gpu, host = torch.zeros(2, 2, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="2 device_offsets, 1 host_offsets and 2 to_host"):
        memcpy_2d_moves_async(gpu, host, [0, 16], [0], [True, False], 32, 48, 16, 2)
    with pytest.raises(ValueError, match="beyond its storage"):
        memcpy_2d_moves_async(gpu, host, [16], [48], [True], 32, 48, 16, 2)
    with pytest.raises(ValueError, match="outside its storage"):
        memcpy_2d_moves_async(gpu, host, [-4], [0], [False], 32, 48, 16, 2)


def test_backend_is_torch_without_cuda():
    assert sgdma.backend() == "torch"


@pytest.fixture
def fresh_loader(monkeypatch):
    """Forget the resolved backend for one test (restored afterwards); no prebuilt module."""
    for name in ("_module", "_backend", "_load_error"):
        monkeypatch.setattr(sgdma, name, None)
    import sys

    import nanovllm

    # `from nanovllm import _sgdma` must fail even where setup.py built it and it was imported
    monkeypatch.delattr(nanovllm, "_sgdma", raising=False)
    monkeypatch.setitem(sys.modules, "nanovllm._sgdma", None)
    return monkeypatch


def test_loader_jit_build_success_is_used_and_logged(fresh_loader, caplog):
    import torch.utils.cpp_extension as cpp_extension

    calls = []
    fake = object()
    fresh_loader.setattr(torch.cuda, "is_available", lambda: True)
    fresh_loader.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or fake)
    with caplog.at_level("INFO", logger="nanovllm.kvcache.memcpy2d"):
        assert sgdma.backend() == "jit" and sgdma.load_error() is None
    assert sgdma._module is fake and len(calls) == 1
    assert calls[0]["name"] == "nanovllm_sgdma" and calls[0]["with_cuda"] is True
    assert calls[0]["sources"][0].endswith("csrc/sgdma.cpp")
    assert any("built/loaded" in r.message for r in caplog.records)
    sgdma.backend()
    assert len(calls) == 1  # resolved once


def test_loader_falls_back_to_torch_when_the_jit_build_fails(fresh_loader, caplog):
    import torch.utils.cpp_extension as cpp_extension

    def broken(**kw):
        raise RuntimeError("nvcc exploded")

    fresh_loader.setattr(torch.cuda, "is_available", lambda: True)
    fresh_loader.setattr(cpp_extension, "load", broken)
    with caplog.at_level("WARNING", logger="nanovllm.kvcache.memcpy2d"):
        assert sgdma.backend() == "torch"
    assert "nvcc exploded" in sgdma.load_error()
    assert any("nvcc exploded" in r.message for r in caplog.records)


def test_loader_without_cuda_does_not_build(fresh_loader):
    import torch.utils.cpp_extension as cpp_extension

    fresh_loader.setattr(torch.cuda, "is_available", lambda: False)
    fresh_loader.setattr(cpp_extension, "load", lambda **kw: pytest.fail("must not build"))
    assert sgdma.backend() == "torch"
    assert "not available" in sgdma.load_error()

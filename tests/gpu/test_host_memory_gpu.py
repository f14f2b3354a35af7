"""Host memory pinned on demand (``nanovllm/kvcache/host_memory.py``, the default on CUDA) on the
GPU: registered memory is read by the UVA gather kernel at its host address, copied by the strided spill copies
and the ring, and torch sees it as pinned.

    python -m pytest tests/gpu/test_host_memory_gpu.py -q
"""
import pytest
import torch

from nanovllm.kvcache.eviction import BlockMove
from nanovllm.kvcache.host_memory import HostMemory, registered_pointers_agree
from nanovllm.kvcache.host_tier import HostTier
from nanovllm.ops import gather_host_pages, gather_host_pages_ref

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def test_the_device_reads_registered_memory_at_its_host_address():
    assert registered_pointers_agree()


def test_cuda_pins_on_demand_by_default_and_at_once_when_asked():
    memory = HostMemory(2, 8, (16, 2, 64), torch.bfloat16, DEVICE)
    assert not memory.eager and not memory.one_allocation and memory.bytes_pinned == 0
    memory.release()
    memory = HostMemory(2, 8, (16, 2, 64), torch.bfloat16, DEVICE, on_demand=False)
    assert memory.one_allocation and memory.k.is_pinned() and memory.bytes_pinned == memory.capacity_bytes


def test_a_copy_inside_one_registration_while_another_is_registered():
    """The hazard the layout avoids is a copy spanning two registrations (SIGSEGV in the driver,
    not testable in-process); a copy inside one while the pinning thread registers the next
    chunks must be correct: the spill of block 0 repeated while chunks 1.. are pinned."""
    layers, blocks, shape = 4, 256, (256, 2, 64)
    tier = HostTier(layers, shape[0], shape[1], shape[2], torch.bfloat16, DEVICE, blocks, 2, chunk_bytes=4 << 20)
    gpu = torch.randn(2, layers, 2, *shape, device=DEVICE).to(torch.bfloat16)
    tier.move([BlockMove(0, 0, True)], gpu[0], gpu[1])  # loads the copy extension: not timed below
    torch.cuda.synchronize()
    tier.memory.reserve(blocks)
    copies = 0
    while tier.memory.pinned_blocks < blocks:
        tier.move([BlockMove(copies % 2, 0, True)], gpu[0], gpu[1])
        torch.cuda.synchronize()
        assert torch.equal(tier.k_host[:, 0], gpu[0, :, copies % 2].cpu())
        copies += 1
    assert copies > 1, "copies ran while chunks were being registered"
    tier.free_memory()


def test_chunks_are_pinned_in_the_background_and_released():
    memory = HostMemory(4, 64, (256, 2, 64), torch.bfloat16, DEVICE, chunk_bytes=8 << 20, on_demand=True)
    assert not memory.eager and memory.chunk_blocks == 16 and memory.bytes_pinned == 0  # 8 MiB / (2 x 4 x 64 KiB)
    memory.start()
    memory.ensure(1)
    assert memory.pinned_blocks >= 16 and memory.k.is_pinned() and memory.v.is_pinned()
    memory.ensure(64)
    assert memory.bytes_pinned == memory.capacity_bytes
    memory.release()
    assert memory.bytes_pinned == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moves_ring_and_gather_over_registered_memory(dtype):
    """Blocks spilled into a late chunk (the copy waits for its pinning), loaded back, read
    through the ring and gathered by the UVA kernel: all equal the GPU blocks they came from."""
    layers, blocks, shape = 3, 24, (256, 2, 64)
    tier = HostTier(layers, shape[0], shape[1], shape[2], dtype, DEVICE, blocks, 6, chunk_bytes=1 << 20,
                    on_demand=True)
    gpu = torch.randn(2, layers, 8, *shape, device=DEVICE).to(dtype)
    moves = [BlockMove(g, h, True) for g, h in ((1, 0), (2, 5), (3, 23))]
    tier.move(moves, gpu[0], gpu[1])
    torch.cuda.synchronize()
    assert tier.memory.pinned_blocks == blocks
    for g, h in ((m.gpu, m.host) for m in moves):
        assert torch.equal(tier.k_host[:, h], gpu[0, :, g].cpu()) and torch.equal(tier.v_host[:, h], gpu[1, :, g].cpu())
    # a write-back ahead of reuse after a step's move: the next step waits for it (wait_ahead)
    tier.move([BlockMove(4, 1, True), BlockMove(5, 2, True, ahead=True)], gpu[0], gpu[1])
    assert tier.ahead_pending
    tier.wait_ahead()
    torch.cuda.current_stream().synchronize()
    assert not tier.ahead_pending
    for g, h in ((4, 1), (5, 2)):
        assert torch.equal(tier.k_host[:, h], gpu[0, :, g].cpu()) and torch.equal(tier.v_host[:, h], gpu[1, :, g].cpu())
    back = gpu.clone()
    tier.move([BlockMove(6, 23, False)], back[0], back[1])
    torch.cuda.synchronize()
    assert torch.equal(back[:, :, 6], gpu[:, :, 3])
    tier.load(0, 0, 2, [5])
    tier.wait(0)
    k, v, _, _ = tier.slots(0, 1)
    assert torch.equal(k[0], gpu[0, 2, 2]) and torch.equal(v[0], gpu[1, 2, 2])
    # a run of consecutive host blocks across a registration boundary: two copies, each inside one
    r = tier.memory.registration_blocks
    assert r is not None and 0 < r < blocks - 1
    run = [r - 1, r, r + 1]
    tier.load(1, 3, 1, run)
    tier.wait(1)
    k, v, _, _ = tier.slots(3, 3)
    torch.cuda.synchronize()
    assert torch.equal(k.cpu(), tier.k_host[1, r - 1:r + 2]) and torch.equal(v.cpu(), tier.v_host[1, r - 1:r + 2])
    page = 16
    ppb = shape[0] // page
    k_pages, v_pages = (cache[1].view(-1, page, *shape[1:]) for cache in (tier.k_host, tier.v_host))
    rows = torch.zeros(2, 4, page, *shape[1:], device=DEVICE, dtype=dtype)
    ref = rows.clone()
    src = torch.tensor([23 * ppb, -1, 1, 5 * ppb + 2], device=DEVICE)  # (host block, page): (23, 0), skip, (0, 1), (5, 2)
    heads = torch.tensor([0, 0, shape[1] - 1, 0], device=DEVICE)
    dst = torch.tensor([0, 1, 2, 3], device=DEVICE)
    gather_host_pages(k_pages, v_pages, src, heads, rows[0], rows[1], dst)
    gather_host_pages_ref(k_pages, v_pages, src, heads, ref[0], ref[1], dst)
    torch.cuda.synchronize()
    assert torch.equal(rows, ref) and torch.equal(rows[0, 0, :, 0], gpu[0, 1, 3, :page, 0])
    tier.free_memory()
    assert tier.memory.bytes_pinned == 0


def test_async_scheduling_with_the_host_tier_equals_the_synchronous_loop():
    """Qwen2.5-0.5B shape (random weights, bf16), GPU tier 8 x 256-token blocks: prefill and
    decode spill, a second round writes back and loads back; async scheduling is on by default with
    the host tier, schedules steps with moves ahead, and gives the synchronous loop's tokens and
    block counts."""
    import gc

    from nanovllm import LLM, SamplingParams
    from tools.random_checkpoint import cached_random_checkpoint

    model = cached_random_checkpoint("qwen2.5-0.5b")
    prompts = [torch.randint(1, 30000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (230, 700, 1500)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    results = []
    for flag in (None, False):
        with LLM(model, max_model_len=2048, max_num_seqs=8, num_kvcache_blocks=8, enable_cpu_offload=True,
                 num_cpu_kvcache_blocks=64, num_ring_slots=2, async_scheduling=flag) as llm:
            assert llm.config.async_scheduling is (flag is None)
            moved_ahead, run = [0], llm.model_runner.run

            def counting_run(seqs, is_prefill, generators=None, moves=(), input_ids=None):
                moved_ahead[0] += input_ids is not None and bool(moves)
                return run(seqs, is_prefill, generators, moves, input_ids)

            llm.model_runner.run = counting_run
            tokens = [[o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
            stats = {k: v for k, v in llm.get_kv_cache_stats().items() if k != "host_bytes_pinned"}
            assert 0 < llm.get_kv_cache_stats()["host_bytes_pinned"] <= llm.model_runner.cache.host.memory.capacity_bytes
            results.append((tokens, stats, moved_ahead[0]))
        gc.collect()
    (tokens, stats, ahead), (ref_tokens, ref_stats, _) = results
    assert tokens == ref_tokens and stats == ref_stats
    assert ahead > 0 and stats["spilled_blocks"] > 0 and stats["evicted_blocks"] > 0, (ahead, stats)

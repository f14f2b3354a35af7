"""QUEST on the GPU: the scoring kernel against its reference at real shapes (bfloat16 included,
which Triton's interpreter cannot check), and the CUDA decode path of a choosing policy (picks
read back through an event, reuse-cache loads on their own streams, the ring's serial plan) on a
tiny checkpoint in float32: reading every block it equals FULL, and the reuse cache changes
traffic, not tokens. Run on the device:

    python -m pytest tests/gpu/test_quest_gpu.py -q
"""
import pytest
import torch

from _util import build_llm, generate_with_logits, random_prompt
from nanovllm.sparse import QuestPolicy
from nanovllm.ops.quest_scores import quest_bounds, quest_bounds_ref, top_blocks
from test_quest import assert_same_picks, random_bounds

pytestmark = pytest.mark.gpu

SHAPES = {"llama-3.1-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}  # Hq, Hkv, D


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_quest_bounds_kernel_equals_reference(shape, dtype):
    """4,096-token blocks (256 pages), 3 sequences over 40 slots with padding and fixed blocks."""
    heads_q, heads_kv, dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(40, 256, 16, heads_kv, dim, device="cuda", generator=gen)
    kmin, kmax = keys.amin(2).to(dtype), keys.amax(2).to(dtype)
    q = torch.randn(3, heads_q, dim, device="cuda", generator=gen).to(dtype)
    slots = torch.randint(0, 40, (3, 33), device="cuda", generator=gen)
    slots[:, 0] = slots[:, -1] = -1
    slots[2, 20:] = -1
    got, want = quest_bounds(q, kmin, kmax, slots), quest_bounds_ref(q, kmin, kmax, slots)
    assert torch.equal(torch.isinf(got), (slots < 0)[..., None].expand_as(got))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("blocks,heads,topk", [(32, 32, 4), (33, 14, 8), (1000, 32, 8), (5000, 14, 16)])
def test_top_blocks_kernel_equals_reference(blocks, heads, topk):
    """The compiled selection kernel picks the reference's blocks (to float rounding of the
    scores), at 130K tokens of 4,096-token blocks and up to 5,000 blocks (heads in several tiles)."""
    for seed in range(3):
        bounds = random_bounds(seed, 5, blocks, heads).cuda()
        assert_same_picks(top_blocks(bounds, 0.088, topk).cpu(), bounds.cpu(), 0.088, topk)


def test_cuda_decode_path_of_quest_equals_full_and_reuse_changes_only_traffic(qwen3_dir, monkeypatch):
    prompts = [random_prompt(n, seed=n) for n in (3000, 1000, 2200, 700)]
    opts = dict(max_model_len=3100, device="cuda", dtype="float32", enforce_eager=False, num_kvcache_blocks=8,
                enable_cpu_offload=True, num_cpu_kvcache_blocks=64, num_ring_slots=3)
    with build_llm(qwen3_dir, **opts) as llm:
        ref = generate_with_logits(llm, prompts, 48)
    quest = dict(sparse_policy="QUEST", sparse_threshold_blocks=0)
    with monkeypatch.context() as patch:
        patch.setattr(QuestPolicy, "selects", lambda self, num_blocks: num_blocks > 3)
        for reuse in (0, 2, 32):
            with build_llm(qwen3_dir, **opts, **quest, sparse_topk_blocks=16, num_reuse_cache_blocks=reuse) as llm:
                tokens, logits = generate_with_logits(llm, prompts, 48)
            assert tokens == ref[0], reuse
            assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(logits, ref[1])), reuse
    stats = {}
    for reuse in (0, 4):
        with build_llm(qwen3_dir, **opts, **quest, sparse_topk_blocks=1, num_reuse_cache_blocks=reuse) as llm:
            stats[reuse] = generate_with_logits(llm, prompts, 48)[0], llm.get_sparse_stats()["decode"]
    assert stats[0][0] == stats[4][0]
    assert stats[4][1]["loaded_host_blocks"] + stats[4][1]["reused_host_blocks"] == stats[0][1]["loaded_host_blocks"]

"""No per-length compile storms on the GPU (issue 14.5): the XATTN_BSA prefill kernels, the per-layer prefill kernels and the decode kernels, run on 12 prompts of distinct lengths
in 1.5-2K tokens (SmolLM2's heads, bf16), add at most the bounded number of compiled variants to each kernel's per-device cache
(tests/_compile_variants.py; the CPU test tests/test_compile_variants.py computes the same keys
without a GPU). Run this file in its own process for exact counts: a variant compiled by an earlier
test with the same shapes is not counted again.
"""
import pytest
import torch

from _compile_variants import PROMPT_LENGTHS, WORKLOADS, kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _compiled(kernel) -> set:
    """Keys of the variants compiled so far for the current device (Triton's ``JITFunction``
    per-device cache: ``device_caches[device][0]`` maps key -> compiled kernel)."""
    return set(kernel.device_caches[torch.cuda.current_device()][0])


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_compiled_variants_bounded_over_12_lengths(workload):
    run, bounds = WORKLOADS[workload]
    by_name = kernels()
    before = {name: _compiled(by_name[name]) for name in bounds}
    for n in PROMPT_LENGTHS:
        run(n, "cuda")
    torch.cuda.synchronize()
    for name, bound in bounds.items():
        compiled = _compiled(by_name[name])
        assert compiled, f"{name} was never compiled: the workload did not launch it"
        new = compiled - before[name]
        assert len(new) <= bound, f"{name}: {len(new)} new variants over {len(PROMPT_LENGTHS)} lengths (bound {bound})"

"""Build script. The package metadata lives in pyproject.toml; CUDA extensions (csrc/) are added
here when a CUDA toolkit is present, and the package installs without them otherwise.

``nanovllm._sgdma`` (csrc/sgdma.cpp, cudaMemcpy2DAsync for strided host<->device copies) is built
when torch is importable at build time, ``torch.utils.cpp_extension.CUDA_HOME`` is set, and either
``torch.cuda.is_available()`` or ``NANOVLLM_BUILD_CUDA=1`` (a GPU-less build machine);
``NANOVLLM_BUILD_CUDA=0`` turns it off. pip's default build isolation hides the installed torch,
so build it with ``pip install -e . --no-build-isolation``. Without the prebuilt module,
nanovllm.kvcache.memcpy2d compiles the same source on first use (or falls back to torch copies).
"""
import os

from setuptools import setup


def _cuda_extensions() -> dict:
    flag = os.environ.get("NANOVLLM_BUILD_CUDA", "").strip()
    if flag == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:  # no torch in this (isolated) build environment: plain package
        return {}
    if CUDA_HOME is None or not (flag == "1" or torch.cuda.is_available()):
        return {}
    ext = CUDAExtension("nanovllm._sgdma", ["csrc/sgdma.cpp"], extra_compile_args={"cxx": ["-O2"]})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**_cuda_extensions())

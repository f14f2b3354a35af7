r"""Which layouts of registered host memory a ``cudaMemcpy2DAsync`` survives; prints JSON.

    python -m benchmarks.probe_host_registration          # CUDA only; each case in its own process

Cases (a 128 MiB anonymous mapping, ``cudaHostRegister`` portable | mapped, a 2-row D2H then H2D
copy of 1 MiB rows through ``nanovllm.kvcache.memcpy2d``): ``one_reg`` (both rows inside one
registration), ``two_regs`` (one row in each of two adjacent registrations), ``slices`` (4 MiB
registrations, rows 16 MiB apart), ``row_straddles`` (a row across a registration boundary),
``tail_unregistered`` (the last row outside any registration), ``concurrent`` (copies inside one
registration while a thread registers another 1 GiB in 4 MiB calls). A case's ``rc`` is its exit
status (-11: SIGSEGV); ``ok`` whether the bytes came back equal. ``HostMemory`` keeps every copy
inside one registration because of the cases that crash (``nanovllm/kvcache/host_memory.py``).
"""
import json
import mmap
import subprocess
import sys
import threading
import time

import torch

MIB = 1 << 20
CASES = ("one_reg", "two_regs", "slices", "row_straddles", "tail_unregistered", "concurrent")


def _register(address: int, size: int):
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, size, 0x01 | 0x02)  # portable | mapped
    if err != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister failed: {cudart.cudaGetErrorString(err)}")


def _register_concurrently(size: int) -> threading.Thread:
    """A thread faulting in and registering a fresh ``size``-byte mapping in 4 MiB calls."""
    other = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    pages = torch.frombuffer(other, dtype=torch.uint8)

    def run():
        for start in range(0, size, 4 * MIB):
            pages[start:start + 4 * MIB].fill_(0)
            _register(pages.data_ptr() + start, 4 * MIB)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def run_case(name: str) -> dict:
    """One case (module doc) in this process; a crash kills it."""
    from nanovllm.kvcache.memcpy2d import memcpy_2d_async

    torch.cuda.set_device(0)
    mapping = mmap.mmap(-1, 128 * MIB, flags=mmap.MAP_PRIVATE)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    host.fill_(0)
    base = host.data_ptr()
    rows = torch.randint(0, 256, (2 * MIB,), dtype=torch.uint8, device="cuda")
    start, pitch = 0, 16 * MIB
    if name in ("one_reg", "concurrent"):
        _register(base, 64 * MIB)
    elif name == "two_regs":
        _register(base, 16 * MIB)
        _register(base + 16 * MIB, 16 * MIB)
    elif name == "slices":
        for offset in range(0, 64 * MIB, 4 * MIB):
            _register(base + offset, 4 * MIB)
    elif name == "row_straddles":
        _register(base, 16 * MIB)
        _register(base + 16 * MIB, 16 * MIB)
        start, pitch = 16 * MIB - MIB // 2, 4 * MIB
    elif name == "tail_unregistered":
        _register(base, 16 * MIB)
    dst = host[start:]
    result = {}
    if name == "concurrent":
        thread, copies, t = _register_concurrently(1024 * MIB), 0, time.perf_counter()
        while thread.is_alive():
            memcpy_2d_async(dst, rows, pitch, MIB, MIB, 2, "d2h")
            torch.cuda.synchronize()
            copies += 1
        thread.join()
        result.update(copies_during_registration=copies, seconds=round(time.perf_counter() - t, 3))
    memcpy_2d_async(dst, rows, pitch, MIB, MIB, 2, "d2h")
    back = torch.empty_like(rows)
    memcpy_2d_async(back, dst, MIB, pitch, MIB, 2, "h2d")
    torch.cuda.synchronize()
    result["ok"] = bool(torch.equal(back, rows))
    return result


def main():
    from nanovllm.kvcache.memcpy2d import backend

    report = {"backend": backend(), "cases": {}}
    for name in CASES:
        p = subprocess.run([sys.executable, "-m", "benchmarks.probe_host_registration", name],
                           capture_output=True, text=True, timeout=120)
        case = {"rc": p.returncode}
        if p.returncode == 0:
            case.update(json.loads(p.stdout.splitlines()[-1]))
        else:
            case["stderr_tail"] = p.stderr[-300:]
        report["cases"][name] = case
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(run_case(sys.argv[1])))
    else:
        main()

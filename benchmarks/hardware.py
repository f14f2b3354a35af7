"""What the benchmarks measure about the machine before they measure the engine: copy bandwidths."""
import torch


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Median seconds of 5 copies (after one warm-up)."""
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times[1:])[2]


def bandwidths(nbytes: int = 1 << 30) -> dict:
    """Pinned host-to-device and HBM (device copy: read + write) GB/s of the current CUDA device;
    NaN without CUDA."""
    if not torch.cuda.is_available():
        return {"pinned_h2d_gb_per_s": float("nan"), "hbm_gb_per_s": float("nan")}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev, dev2 = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    result = {"pinned_h2d_gb_per_s": round(nbytes / _timed_copy(dev, host) / 1e9, 1),
              "hbm_gb_per_s": round(2 * nbytes / _timed_copy(dev2, dev) / 1e9, 1)}
    del host, dev, dev2
    torch.cuda.empty_cache()
    return result

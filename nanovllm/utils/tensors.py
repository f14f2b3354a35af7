"""Host lists to device tensors."""
import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (a list, or a list of equal-length lists) as a ``dtype`` tensor on ``device``:
    built in pinned memory and copied without blocking the host on CUDA."""
    t = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


def padded_rows(rows: list[list[int]], width: int, fill: int = -1) -> list[list[int]]:
    """``rows`` right-padded with ``fill`` to ``width`` entries each."""
    return [row + [fill] * (width - len(row)) for row in rows]

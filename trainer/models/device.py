"""Moving host-built tensors to a device without a host sync."""

from __future__ import annotations

import torch


def host_to(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``: a CUDA copy goes through page-locked memory, so it is
    asynchronous (a copy from pageable memory makes the host wait for the device's queue)."""
    device = torch.device(device) if device is not None else tensor.device
    if device == tensor.device:
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)

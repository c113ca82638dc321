"""The torch settings the lab's commands take from their flags (threads, the device's name),
here so that the CLI, which parses those flags, never imports torch itself."""

from __future__ import annotations


def use_threads(threads: int | None) -> None:
    """Run torch's CPU ops on ``threads`` threads (None or 0: torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_name(device: str) -> str:
    """The GPU's name for a CUDA ``device`` (as reports print it), else ``cpu``."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"

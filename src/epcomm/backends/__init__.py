"""Backends behind `Buffer`: "collective" (torch.distributed all-to-all) and "symmetric"
(Triton kernels over peer memory), both behind the interface of `base`."""
from __future__ import annotations

import torch.distributed as dist

from .base import Backend, BufferConfig
from .collective import CollectiveBackend


def make_backend(choice: str, group: dist.ProcessGroup, config: BufferConfig) -> Backend:
    """Build the backend `choice` ("auto", "collective" or "symmetric") over `group`.

    "auto" takes the symmetric backend only for CUDA buffers: on CPU its kernels run in the
    Triton interpreter, which is for tests, not speed. Collective over `group`.
    """
    if choice == "symmetric" or (choice == "auto" and config.device.type == "cuda"):
        try:
            from .symmetric import SymmetricBackend, symmetric_supported
        except ImportError as exc:  # Triton missing
            if choice == "symmetric":
                raise RuntimeError(f"the symmetric backend is not available: {exc}") from exc
        else:
            if choice == "symmetric" or symmetric_supported(group, config):
                return SymmetricBackend(group, config)
    return CollectiveBackend(group, config)

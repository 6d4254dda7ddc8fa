"""Backends behind `Buffer`: "collective" (torch.distributed all-to-all) and "symmetric"
(Triton kernels over peer memory)."""
from __future__ import annotations

from .base import Backend
from .collective import CollectiveBackend


def make_backend(choice: str, buffer) -> Backend:
    """Build the backend `choice` ("auto", "collective" or "symmetric") for `buffer`.

    "auto" takes the symmetric backend only for CUDA buffers: on CPU its kernels run in the
    Triton interpreter, which is for tests, not speed.
    """
    if choice == "symmetric" or (choice == "auto" and buffer.device.type == "cuda"):
        try:
            from .symmetric import SymmetricBackend, symmetric_supported
        except ImportError as exc:  # Triton missing, or the backend not built yet
            if choice == "symmetric":
                raise RuntimeError(f"the symmetric backend is not available: {exc}") from exc
        else:
            if choice == "symmetric" or symmetric_supported(buffer):
                return SymmetricBackend(buffer)
    return CollectiveBackend(buffer.group, buffer.device, buffer.timeout_s)

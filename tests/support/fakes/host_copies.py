"""Pinned host memory and asynchronous device-to-host copies, for a fake device whose tensors are CPU tensors.

On CUDA and NPU, ``host.copy_(device_tensor, non_blocking=True)`` into page-locked (pinned) host memory only
queues the copy on the device's stream and returns: the stream reads the source in its order (after the
work queued before, before the work queued after), but the host memory holds the data only once the
stream has run the copy, which the host learns from ``synchronize()``. Until then it holds what it held.
A CPU build of torch has neither: it cannot pin memory without a device runtime, and its copies are done
when ``copy_`` returns.

``LateHostCopies`` gives a fake device (tests/support/fakes/npu.py's, whose tensors are CPU tensors) that
behaviour at torch's own functions, without touching the code under test:
- ``torch.empty(..., pin_memory=True)`` returns host memory recorded as pinned, filled with ``UNFILLED``
  (what a fresh or reused buffer holds before a copy lands in it);
- ``Tensor.is_pinned()`` (and so ``UntypedStorage.is_pinned()``) says True for tensors over that memory;
- ``copy_(src, non_blocking=True)`` into it reads ``src`` now (the stream's order) and writes the host
  memory only when the device module's ``synchronize()`` runs.
Everything else runs as torch runs it. The mode is thread-local, as torch's function modes are: it sees
the calls of the thread that enters it (the training thread), not those of threads started inside it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: the byte pinned memory holds until a copy lands in it: 0xFF bytes read as NaN in fp32, bf16 and fp16
UNFILLED = 0xFF


class LateHostCopies(TorchFunctionMode):
    """Pinned host buffers whose ``non_blocking`` copies land at ``device_module.synchronize()``.

    Use as a context manager on the training thread; ``made`` counts the asynchronous copies asked for,
    ``queued`` those still waiting for a synchronize.
    """

    def __init__(self, device_module: Any) -> None:
        super().__init__()
        self._module = device_module
        self._device_synchronize = device_module.synchronize
        #: each pinned storage by its address (held, so that no other allocation takes the address)
        self._pinned: dict[int, torch.UntypedStorage] = {}
        self._queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.made = 0

    @property
    def queued(self) -> int:
        """Copies waiting for a synchronize."""
        return len(self._queue)

    def __enter__(self) -> LateHostCopies:
        self._module.synchronize = self.synchronize
        return super().__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, tb)
        self._module.synchronize = self._device_synchronize

    def synchronize(self, device: Any = None) -> None:
        """The device module's ``synchronize``: the queued copies land in host memory, then the device's own."""
        for host, data in self._queue:
            host.copy_(data)  # blocking: not queued again
        self._queue.clear()
        self._device_synchronize(device)

    def _is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._pinned

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("pin_memory"):
            buffer = torch.empty(*args, **{**kwargs, "pin_memory": False})
            if buffer.numel():  # an empty storage has no address of its own (0)
                buffer.view(torch.uint8).fill_(UNFILLED)
                self._pinned[buffer.untyped_storage().data_ptr()] = buffer.untyped_storage()
            return buffer
        if func is torch.Tensor.is_pinned:
            return self._is_pinned(args[0])
        if func is torch.Tensor.copy_:
            host, source = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if non_blocking and self._is_pinned(host):
                self._queue.append((host, source.detach().clone()))  # the stream reads the source in order
                self.made += 1
                return host
        return func(*args, **kwargs)

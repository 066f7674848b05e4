"""The Accelerator's collectives over its processes: ``gather``, ``reduce``, ``gather_for_metrics``.

``GatherMethods`` is a mixin of ``xshard.Accelerator`` (as ``AccelerateSurface`` is). Each call runs the
backend's collectives (whose byte counter the core's ``stats()`` may share: call them outside the window
you measure) on tensors nested in dicts, lists and tuples (``xshard.accelerate_compat.metrics``), and reads
only the core members ``AcceleratorCore`` declares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import metrics

if TYPE_CHECKING:
    from .accelerator_core import AcceleratorCore
else:  # at run time a plain mixin: the core members come from xshard.Accelerator
    AcceleratorCore = object


class GatherMethods(AcceleratorCore):
    """The Accelerator's gather and reduce members (see the module docstring)."""

    def gather(self, data: Any) -> Any:
        """Concatenate every rank's tensor(s) along dim 0 (0-dim tensors become a vector of W values).

        Works on nested dicts/lists/tuples of tensors; shapes must match across ranks.
        """
        return self._cut_after_collectives(metrics.map_tensors(data, self._gather_one))

    def _cut_after_collectives(self, result: Any) -> Any:
        """On devices that compile graphs (XLA), run the collectives just traced now, in a graph cut
        here on every rank (XLA:CPU's replica threads meet before compiling it): a later read of the
        result is then a copy, not a graph with a collective that one rank runs on its own time."""
        if self.backend.compiles_graphs and self.world_size > 1:
            self.backend.mark_step()
        return result

    def _gather_one(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(self.device)
        t = t.reshape(1) if t.dim() == 0 else t.contiguous()
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        self.backend.collectives.all_gather_into_tensor(out, t)
        return out

    def reduce(self, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sum, average or max of tensor(s) over ranks, times ``scale`` ("none": unchanged); returns
        new tensors (the inputs are left alone). The default is a sum, as in Accelerate."""
        ops = {"mean": "avg", "sum": "sum", "max": "max", "none": None}
        if reduction not in ops:
            raise ValueError(f"reduce(reduction={reduction!r}): use 'sum', 'mean', 'max' or 'none'")

        def one(t: torch.Tensor) -> torch.Tensor:
            out = t.detach().to(self.device).clone()
            if not out.is_floating_point() and reduction == "mean":
                out = out.float()
            op = ops[reduction]
            if op is not None and self.world_size > 1:
                self.backend.collectives.all_reduce(out, op=op)
            return out * scale if scale != 1.0 else out

        return self._cut_after_collectives(metrics.map_tensors(data, one))

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` of per-sample values in the loader's order, each sample once
        (``xshard.accelerate_compat.metrics``).

        37 evaluation samples on 2 processes give 37 values, not 38, in the order the loader reads
        the data set (so they line up with its labels). Non-tensor data (or
        ``use_gather_object=True``) is gathered as Python objects: a list per process, joined.
        """
        if use_gather_object or not metrics.only_tensors(input_data):
            data = metrics.gather_object(self.backend.collectives, self.device, input_data)
        else:
            data = self.gather(input_data)
        loader = self.job.active_loader()
        found = loader.real_counts() if loader is not None else None
        if found is None:
            return data
        counts, batch_len = found
        assert loader is not None  # found is None without a loader
        return metrics.in_loader_order(data, counts, batch_len, self.world_size, loader.batch_size)

"""``DevicePeak``: the peak FLOPS of the device a job computes on, found once, for its throughput reports.

The figure is looked up when the first report asks (``xshard.runtime.throughput.peak_flops``: the
``XSHARD_PEAK_TFLOPS`` override, the backend's table, or a CPU's measurement), in the compute dtype of that
moment, and kept: a CPU's probe runs once a job.
"""

from __future__ import annotations

import torch

from ..backends import Backend
from .throughput import PEAK_ENV, PeakFlops, peak_flops


class DevicePeak:
    """The peak of ``backend``'s device (see the module docstring)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._found: PeakFlops | None = None

    def __call__(self, dtype: torch.dtype | None) -> PeakFlops:
        """The peak in ``dtype`` (the first call's dtype: the figure is found once)."""
        if self._found is None:
            self._found = self._find(dtype)
        return self._found

    def _find(self, dtype: torch.dtype | None) -> PeakFlops:
        try:
            name = self.backend.device_name()
        except Exception as exc:  # a metric never ends a run: no peak, and the report says why
            return PeakFlops(None, f"the device's name could not be read ({type(exc).__name__}: {exc}): set {PEAK_ENV}")
        return peak_flops(name, dtype, table=self.backend.peak_tflops,
                          measure=lambda: self.backend.measured_peak_tflops(dtype))

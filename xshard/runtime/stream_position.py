"""A stream's own record of where it is, so that a resume starts it there instead of reading it again.

A stream with ``state_dict()`` and ``load_state_dict()`` (a ``datasets.IterableDataset``, a torchdata-style
stateful dataset) can restart mid-pass by itself; any other stream resumes by reading the batches it had
consumed and dropping them, which for a large corpus can take as long as the training did.

``StreamPosition`` asks the stream for its state before each batch the prepared loader reads, and keeps
the states of the batch in use and of the one read ahead (the loader looks one batch ahead). A checkpoint
keeps, for each rank, the state the stream had after the last batch the program used; a resumed pass of
the same epoch at the same position hands it back to the stream and reads nothing twice.

Only where the stream is read in the loader's own process (``num_workers=0``): with workers each worker
iterates its own copy of the stream, whose state never reaches the loader's process (torchdata's
``StatefulDataLoader`` sends it back with the batches; torch's ``DataLoader`` does not), so those resume by
reading again. A stream split by node whose rank's part ends before the others' reads its pass's first batch
again; a resumed pass reads that batch from the pass's start before the stream jumps ahead. Known difference
from an uninterrupted run: a stream cut per global batch completes its last, short window with samples of the
pass's first window, which after such a resume is the first window read after it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch


def _plain(obj: Any) -> bool:
    """True for what a checkpoint reads back with ``torch.load(weights_only=True)``: containers of numbers,
    strings, ``None`` and tensors."""
    if isinstance(obj, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    return obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor))


def _stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class StreamPosition:
    """The stream ``dataset``'s state per batch read (see the module docstring); inert where it cannot help."""

    def __init__(self, dataset: Any, num_workers: int) -> None:
        #: the stream whose state is kept (None: not stateful, or read by workers)
        self.dataset = dataset if dataset is not None and num_workers == 0 and _stateful(dataset) else None
        self._states: dict[tuple[int, int], Any] = {}  # (epoch, batches read) -> the stream's state then
        self._restored: dict[str, Any] | None = None

    def before_read(self, epoch: int, batches_read: int) -> None:
        """Record the stream's state before it gives batch ``batches_read`` of ``epoch`` (0-based)."""
        if self.dataset is None:
            return
        self._states = {key: s for key, s in self._states.items() if key == (epoch, batches_read - 1)}
        self._states[(epoch, batches_read)] = copy.deepcopy(self.dataset.state_dict())

    def state_dict(self, epoch: int, batches_consumed: int) -> dict[str, Any]:
        """The stream's state after ``batches_consumed`` batches of ``epoch`` (empty when not recorded)."""
        state = self._states.get((epoch, batches_consumed))
        if state is None or batches_consumed == 0 or not _plain(state):  # (not plain: the stream is read again)
            return {}
        return {"stream_state": state, "stream_epoch": epoch, "stream_batches": batches_consumed}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Keep ``state`` for the pass that resumes at its position (``resume``)."""
        self._restored = dict(state) if state and "stream_state" in state else None

    def restorable(self, epoch: int, batches_consumed: int) -> bool:
        """Whether a pass of ``epoch`` that starts after ``batches_consumed`` batches will restore the stream."""
        restored = self._restored
        return (self.dataset is not None and restored is not None and batches_consumed > 0
                and (restored["stream_epoch"], restored["stream_batches"]) == (epoch, batches_consumed))

    def resume(self, epoch: int, batches_consumed: int) -> bool:
        """At the start of a pass: give the stream its saved state when the pass starts where it was saved
        (True: the stream is there, nothing to skip); the saved state is used once."""
        restorable, restored, self._restored = self.restorable(epoch, batches_consumed), self._restored, None
        if not restorable or restored is None or self.dataset is None:
            return False
        self.dataset.load_state_dict(restored["stream_state"])
        self._states = {(epoch, batches_consumed): restored["stream_state"]}
        return True

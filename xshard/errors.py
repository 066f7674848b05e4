"""xshard's errors: the root ``XShardError`` and the errors a user sees from the device layer.

The leaf of the import graph: every layer (the device layer ``xshard.backends``, the sharded core,
checkpoints, config, the CLI) imports its errors from here and nothing here imports xshard. Each
error's message names the problem and the fix.
"""

from __future__ import annotations


class XShardError(Exception):
    """Base of xshard's user-facing errors (the CLI prints the message and exits non-zero)."""

    exit_code = 2


class UnknownBackendError(XShardError, ValueError):
    """XSHARD_BACKEND or backend= names no known backend."""


class BackendUnavailableError(XShardError, RuntimeError):
    """A backend was asked for explicitly but cannot run here (missing package, driver or device)."""


class BackendConflictError(XShardError, ValueError):
    """The backend= argument in code contradicts XSHARD_BACKEND in the environment."""


class WorldSizeError(XShardError, RuntimeError):
    """The job has more processes than the backend can run (MPS: one)."""


class VisibleDevicesError(XShardError, ValueError):
    """The ``devices`` option is malformed, or cannot take effect (runtime started, or a conflicting
    visible-devices variable is already exported)."""


class WorldEnvironmentError(XShardError, ValueError):
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) are malformed or inconsistent."""


class CollectiveMismatchError(XShardError, RuntimeError):
    """Ranks issued different collectives (data-dependent control flow across sharded units)."""


class CollectiveTimeoutError(XShardError, RuntimeError):
    """A collective waited past the process-group timeout (or a peer died in it); the message names the
    ranks that never arrived and where every rank was."""


class RankDiedError(XShardError, RuntimeError):
    """A peer process died (killed, crashed, its node lost) while this rank waited in a collective; the
    message names the dead rank(s) and the collective this rank waited in."""

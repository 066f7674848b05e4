"""The communication role of a Backend: the job's process group and its collectives.

``CommunicationAPI`` implements the torch.distributed (c10d) default that cpu, cuda and npu share:
``init_process_group`` from torchrun's environment contract, ``collectives`` over the default group,
``local_collectives()`` for a world of one. A backend without a c10d group (XLA) overrides the
collectives it builds; ``backends/README.md`` lists the members and their rules.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist

# Imported before any process group forms, never after: torch.distributed.nn.functional binds
# ``group.WORLD`` as the default argument of its ten collectives when it is first imported. Imported
# while a group exists (torch.distributed.fsdp, and so torch._dynamo, import it), it keeps that group
# alive for good: ``destroy_process_group()`` then frees nothing, the group's gloo threads outlive it
# and can abort the interpreter's shutdown (see ``leave_at_exit``). Measured: a 2-rank gloo job that
# imports torch._dynamo after ``init_process_group`` keeps its 3 gloo threads past the destroy; one
# that imported this module first keeps none.
if dist.is_available():  # a torch built without distributed has no group to keep
    import torch.distributed.nn.functional  # noqa: F401

from ..errors import WorldEnvironmentError, WorldSizeError
from .collectives import IN_FLIGHT, Collectives, DistCollectives, SingleProcessCollectives
from .diagnostics import monitor
from .world import DEFAULT_MASTER_ADDR as DEFAULT_MASTER_ADDR  # re-exported: defined with World now
from .world import DEFAULT_MASTER_PORT as DEFAULT_MASTER_PORT
from .world import World

log = logging.getLogger("xshard.backends")

class CommunicationAPI:
    """Process group, collectives and the world-size rules. Mixed into ``Backend``."""

    #: torch.distributed backend name, or None when the backend has no c10d process group
    dist_backend: ClassVar[str | None] = None
    #: does the process group implement ReduceOp.AVG? (NCCL yes; gloo, XLA: SUM then divide)
    native_avg: ClassVar[bool] = False
    #: the most processes one job may have (MPS: 1), None for no limit
    max_world_size: ClassVar[int | None] = None

    # set by Backend
    name: ClassVar[str]
    world: World
    _collectives: Collectives | None
    _owns_process_group: bool
    #: subgroup collectives made by ``group_collectives``, by (groups, kind suffix)
    _subgroups: dict[tuple[tuple[tuple[int, ...], ...], str], Collectives]
    #: the process group's timeout, once started (the collectives' hang diagnosis reads it)
    _timeout: datetime.timedelta | None = None

    if TYPE_CHECKING:  # the device role's members this role calls (``DeviceAPI``; Backend mixes both in)
        def set_device(self) -> None:
            """The device role's (``DeviceAPI.set_device``)."""

        def device(self, local_rank: int | None = None) -> torch.device:
            """The device role's (``DeviceAPI.device``)."""

    # ------------------------------------------------------------------ the world
    def check_world(self) -> None:
        """Refuse a world this backend cannot run, with the reason."""
        if self.max_world_size is not None and self.world.world_size > self.max_world_size:
            raise WorldSizeError(
                f"{self.name} runs at most {self.max_world_size} process(es), but WORLD_SIZE="
                f"{self.world.world_size}: {self.world_size_hint()}"
            )

    def world_size_hint(self) -> str:
        """Why the world size is limited, and what to do instead."""
        return "start fewer processes"

    @property
    def timeout(self) -> float | None:
        """The job's timeout in seconds: how long a collective, and whatever waits for the other ranks
        (the hang diagnosis, an async save's commit), may wait. Set by ``init_process_group``; None
        before it, or where it was given none (torch's default then applies to the process group)."""
        return self._timeout.total_seconds() if self._timeout is not None else None

    # ------------------------------------------------------------------ process group
    def init_process_group(self, timeout: datetime.timedelta | float | None = None, *, always: bool = False) -> None:
        """Join the job's process group (torchrun's env contract; one process needs no variables).

        Binds the device for the local rank first, as NCCL and HCCL require. ``always=True`` starts
        a real one-rank group even for a world of one, so that the collective library itself runs
        (the self-test of `xshard env --check` uses it); ``collectives`` then goes through it.
        """
        self.check_world()
        timeout = as_timedelta(timeout)
        self._timeout = timeout
        if self.world.world_size > 1 or self.dist_backend is not None:
            self.set_device()  # the device role's
        if self.dist_backend is None or (self.world.world_size == 1 and not always):
            return
        if dist.is_initialized():
            # Someone (the user, another library) started it: use it if it is this job's world.
            if dist.get_world_size() != self.world.world_size or dist.get_rank() != self.world.rank:
                raise WorldEnvironmentError(
                    f"a process group is already running as rank {dist.get_rank()} of {dist.get_world_size()}, "
                    f"but the environment says rank {self.world.rank} of {self.world.world_size}: "
                    "start the process group once, with the launcher's RANK and WORLD_SIZE"
                )
            if _ExitGuard.owner is None:  # nobody else leaves it at exit (transformers' arguments start
                _ExitGuard.owner = self  # Accelerate's PartialState, whose group is never left): this backend does
            return
        kwargs: dict[str, Any] = {
            "backend": self.dist_backend,
            "rank": self.world.rank,
            "world_size": self.world.world_size,
        }
        if self.world.world_size == 1:
            kwargs["store"] = dist.HashStore()  # a world of one needs no rendezvous address
        else:
            self.world.export()  # c10d's env:// rendezvous reads them (a Slurm or MPI world sets none)
            store = rendezvous_store(timeout)
            if store is not None:
                kwargs["store"] = store
        if timeout is not None:
            kwargs["timeout"] = timeout
        kwargs.update(self.process_group_options())
        dist.init_process_group(**kwargs)
        _Generation.started += 1
        self._owns_process_group = True
        self._collectives = None
        _ExitGuard.owner = self
        log.debug("process group %s: rank %d of %d", self.dist_backend, self.world.rank, self.world.world_size)

    def process_group_options(self) -> dict[str, Any]:
        """Extra keyword arguments for ``torch.distributed.init_process_group`` on this backend."""
        return {}

    def destroy_process_group(self) -> None:
        """Leave the process group this backend started (no-op otherwise).

        Also done at the interpreter's exit for a script that never calls ``end_training()``
        (``leave_at_exit``), unless a collective of this process is still in flight then.
        """
        if self._collectives is not None and self._collectives.monitor is not None:
            self._collectives.monitor.stop()
        if self._owns_process_group and dist.is_initialized():
            monitor.stop_all()  # every backend's monitor watches the group that goes away (diagnostics/monitor.py)
            dist.destroy_process_group()
        if _ExitGuard.owner is self and not dist.is_initialized():  # a group it joined still runs: left at exit
            _ExitGuard.owner = None
        self._owns_process_group = False
        self._collectives = None
        self._subgroups.clear()

    def leave_at_exit(self) -> None:
        """At the interpreter's exit: leave the process group if this process has no collective in flight,
        whether this backend started it or joined one another library started and nobody leaves (the
        transformers arguments of a TRL config start Accelerate's ``PartialState``, and a TRL job through
        ``TrainerMixin`` ended with exit 134 after all its work, as below).

        Why. The process group's threads release each finished work's tensors, and a tensor that has
        a Python object takes the GIL to do so. A work released after the interpreter began to shut
        down cannot take it: CPython ends the thread with ``pthread_exit``, whose forced unwind meets
        a ``noexcept`` destructor, and the process aborts ("terminate called without an active
        exception", exit 134) after the script did all its work. Two-rank gloo jobs whose script ended
        right after ``optimizer.step()`` did one run in four (stock torchrun + Accelerate do the same).
        Leaving the group here, while the interpreter is whole, joins those threads first (c10d
        destroys a process group with the GIL released).

        Not with a collective in flight (the script failed mid-step): leaving would wait for it, that
        is for peers that may never come, and a failing rank must end at once so that the others
        learn of it.
        """
        if _ExitGuard.owner is not self or not dist.is_initialized():
            return
        if IN_FLIGHT.count:  # any backend's collectives: the Trainer's arguments and its Accelerator each have one
            log.debug("process group kept at exit: %d collective(s) in flight", IN_FLIGHT.count)
            return
        self._owns_process_group = True  # at exit the group is this backend's to leave, whoever started it
        self.destroy_process_group()

    # ------------------------------------------------------------------ collectives
    @property
    def collectives(self) -> Collectives:
        """The collectives of this job: ``local_collectives()`` for one process, c10d ones otherwise."""
        if self._collectives is None:
            self._collectives = self._make_collectives()
        return self._collectives

    def local_collectives(self) -> Collectives:
        """Collectives of a world of one on this device (each operation is a local copy or no-op)."""
        return SingleProcessCollectives()

    def _make_collectives(self) -> Collectives:
        if self.world.world_size == 1 and not self._owns_process_group:
            return self.local_collectives()
        if not dist.is_initialized():
            raise RuntimeError(
                f"{self.name}: WORLD_SIZE={self.world.world_size} but no process group is running: "
                "call backend.init_process_group() (Accelerator does this) first"
            )
        return DistCollectives(native_avg=self.native_avg, device=self.device(), timeout=self.timeout,
                               **self.collective_options())

    def collective_options(self) -> dict[str, Any]:
        """Per-backend choices of how DistCollectives implements each operation."""
        return {}

    def group_collectives(self, groups: Sequence[Sequence[int]], kind_suffix: str = "") -> Collectives:
        """Collectives over the one group of ``groups`` that holds this rank.

        ``groups`` lists disjoint groups of global ranks covering the whole job (e.g. hybrid sharding's
        shard groups, one per node, or its replica groups, across nodes). Every rank must call this
        with the same ``groups`` in the same order, because making a process group is itself collective
        on c10d (every rank creates every group) and XLA's replica groups name every group in every
        collective. The result counts into ``collectives``' books (``Collectives.share_books``), its
        kinds suffixed with ``kind_suffix``. Made once per backend and reused: a second model with the
        same groups creates no new process group. A group of the whole job is ``collectives`` itself
        (when the suffix is empty); a group of one rank is ``local_collectives()``.
        """
        key = (tuple(tuple(int(r) for r in g) for g in groups), str(kind_suffix))
        cached = self._subgroups.get(key)
        if cached is not None:
            return cached
        world, rank = self.world.world_size, self.world.rank
        flat = sorted(r for g in key[0] for r in g)
        if flat != list(range(world)) or any(not g for g in key[0]):
            raise ValueError(f"group_collectives: the groups {[list(g) for g in key[0]]} must split the ranks "
                             f"0..{world - 1} into disjoint, non-empty groups (each rank in exactly one)")
        mine = next(g for g in key[0] if rank in g)
        if len(mine) == world and not kind_suffix:
            made = self.collectives
        elif len(mine) == 1:
            made = self.local_collectives().share_books(self.collectives, kind_suffix)
        else:
            made = self._subgroup_collectives(key[0], mine).share_books(self.collectives, kind_suffix)
        self._subgroups[key] = made
        return made

    def _subgroup_collectives(self, groups: tuple[tuple[int, ...], ...], mine: tuple[int, ...]) -> Collectives:
        """Collectives over ``mine``, one of ``groups`` (c10d: every rank creates every group, in order)."""
        if not dist.is_initialized():
            raise RuntimeError(f"{self.name}: subgroups need the job's process group: call "
                               "backend.init_process_group() (Accelerator does this) first")
        kwargs: dict[str, Any] = {} if self._timeout is None else {"timeout": self._timeout}
        handle = None
        for ranks in groups:
            group = dist.new_group(list(ranks), **kwargs)
            if ranks == mine:
                handle = group
        return DistCollectives(native_avg=self.native_avg, group=handle, device=self.device(),
                               **self.collective_options())


def as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    """A process-group timeout given as seconds or a timedelta; None keeps torch's default."""
    if timeout is None:
        return None
    if not isinstance(timeout, datetime.timedelta):
        try:
            timeout = datetime.timedelta(seconds=float(timeout))
        except (TypeError, ValueError):
            raise ValueError(f"timeout={timeout!r} is not a number of seconds or a timedelta") from None
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout} must be positive (seconds, or a timedelta)")
    return timeout


class _Generation:
    """How many process groups this process has started (each later one rendezvouses under a prefix)."""

    started = 0


def rendezvous_store(timeout: datetime.timedelta | None) -> Any:
    """The key-value store to rendezvous in, under a prefix of its own where keys of an earlier group
    could be read; None where torch's own env:// rendezvous is fresh (the first group of a first attempt).

    A process group publishes its ranks' addresses as keys under its name, and the default group is
    always named "0". Two cases reuse a store whose old keys are still there:

    - a torchrun restart: the workers share the agent's store across attempts
      (TORCHELASTIC_USE_AGENT_STORE), so a restarted rank may read its peer's address of the last
      attempt before the peer wrote its new one, and fail to connect (gloo: "Connection refused");
    - a second group in the same processes (a script that ends its job and starts another
      Accelerator): the store still held the ended group's addresses, and when rank 0 came late the
      new group read them and failed to connect ("Connection refused" after the timeout).

    A prefix per attempt and per group gives each fresh keys; every rank starts its groups in the same
    order, so they agree on it.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and attempt != "0"
    if not agent_store and _Generation.started == 0:
        return None
    wait = timeout or datetime.timedelta(minutes=30)
    if agent_store:  # the agent hosts the store; every worker is a client
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=wait)
    else:
        store, _, _ = next(dist.rendezvous("env://", timeout=wait))
    return dist.PrefixStore(f"xshard/attempt_{attempt}/group_{_Generation.started}", store)


class _ExitGuard:
    """The backend that leaves this process's process group at exit (``leave_at_exit``): the one that started
    it, else the first that joined a group another library started."""

    owner: CommunicationAPI | None = None

    @classmethod
    def leave(cls) -> None:
        if cls.owner is not None:
            cls.owner.leave_at_exit()


atexit.register(_ExitGuard.leave)

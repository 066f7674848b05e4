"""The lowered forward graph of a stage-3 model on XLA (HLO text), and what it keeps alive together.

``forward_hlo`` (run on each XLA:CPU replica) shards the README's minimal example's model at stage 3,
traces one forward and returns the HLO text of its loss (nothing is compiled or run). ``units_live_together``
reads that text: each unit's all-gather (one per unit, in channel-id order: the root first), the
values derived from it without computing (reshapes, slices, tuples, optimization barriers), and the
instructions that compute with them. Unit k's gathered parameters are dead before unit k+1's gather
exists in every schedule the compiler may choose exactly when each of those computing instructions
is an ancestor of that gather. The root unit (input projection and head) is gathered for the whole
forward by design and left out.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
#: opcodes that pass a buffer on without computing a new value from it
_PASS_THROUGH = {"reshape", "slice", "bitcast", "transpose", "get-tuple-element", "tuple", "opt-barrier", "copy",
                 "convert", "dynamic-slice", "broadcast"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(")


def forward_hlo(rank: int, world_size: int, fenced: bool) -> str:
    import torch_xla

    from xshard.backends import get_backend
    from xshard.sharding import ShardingOptions, shard_model

    sys.path.insert(0, str(ROOT / "examples"))
    import minimal

    backend = get_backend("xla")
    if not fenced:  # what the graph looks like without the fences, to show the check can fail
        backend.optimization_barrier = lambda tensors: None
    torch.manual_seed(0)
    model = shard_model(minimal.TinyModel(), backend, ShardingOptions(stage=3))
    backend.mark_step()
    x = torch.randn(8, 16, device=backend.device())
    y = torch.randn(8, device=backend.device())
    loss = model(x, y)
    text = torch_xla._XLAC._get_xla_tensors_hlo([loss])
    backend.mark_step()
    return text


def _entry(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (opcode, operand names) of every instruction of the ENTRY computation."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    graph: dict[str, tuple[str, list[str]]] = {}
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        op = _OPCODE.match(rest)
        opcode = op.group(1) if op else ""
        operands = [t for t in re.findall(r"%([\w.\-]+)", rest.split(", metadata=")[0]) if t != name]
        graph[name] = (opcode, operands)
    return graph


def units_live_together(text: str) -> list[tuple[int, int, list[str]]]:
    """(unit k, unit k+1, k's computing uses that need not run before k+1's gather) for each
    consecutive pair of non-root units where some do; empty when no two are ever live together."""
    graph = _entry(text)
    channels = {}
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        c = re.search(r"channel_id=(\d+)", line)
        if m and c and m.group(1) in graph and graph[m.group(1)][0] == "all-gather":
            channels[int(c.group(1))] = m.group(1)
    gathers = [channels[c] for c in sorted(channels)][1:]  # the root's gather first
    users: dict[str, list[str]] = {}
    for name, (_, operands) in graph.items():
        for o in operands:
            users.setdefault(o, []).append(name)

    def computing_uses(gather: str) -> set[str]:
        seen, todo, uses = {gather}, [gather], set()
        while todo:
            for user in users.get(todo.pop(), []):
                if graph[user][0] in _PASS_THROUGH:
                    if user not in seen:
                        seen.add(user)
                        todo.append(user)
                else:
                    uses.add(user)
        return uses

    def ancestors(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            for o in graph.get(todo.pop(), ("", []))[1]:
                if o not in seen:
                    seen.add(o)
                    todo.append(o)
        return seen

    together = []
    for k in range(len(gathers) - 1):
        before_next = ancestors(gathers[k + 1])
        late = sorted(u for u in computing_uses(gathers[k]) if u not in before_next)
        if late:
            together.append((k + 1, k + 2, late))
    return together


def summary(text: str) -> dict[str, Any]:
    """How many units' gathers the graph has, and the pairs live together."""
    return {"gathers": text.count(" all-gather("), "together": units_live_together(text)}

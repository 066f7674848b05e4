"""Leaving the process group xshard started ends its threads, whatever the script imports after it formed.

torch.distributed.nn.functional binds ``group.WORLD`` as a default argument when it is first imported;
imported while a group exists (torch.distributed.fsdp and torch._dynamo import it, and torch's optimizers
import torch._dynamo at construction), it would keep that group alive past ``destroy_process_group()``,
and the group's gloo threads could abort the interpreter's shutdown (pytorch#190489's family). xshard
imports it before any group forms (backends/communication.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.distributed import free_port

pytestmark = pytest.mark.multiprocess

# The group formed the way `xshard env --check` forms it (no torch._dynamo imported yet), then the
# imports a training script does after it; each rank prints its threads before and after leaving.
SCRIPT = r'''
import os
import torch
from xshard.backends import get_backend

def gloo_threads():
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n)

backend = get_backend("cpu")
backend.init_process_group()
import torch._dynamo  # what torch.optim.AdamW(...) imports, after the group formed
t = torch.ones(4)
backend.collectives.all_reduce(t, op="sum")
assert t.tolist() == [2.0] * 4
during = gloo_threads()
backend.destroy_process_group()
os.write(1, f"rank {os.environ['RANK']} gloo threads: {bool(during)} -> {gloo_threads()}\n".encode())
'''


def _two_ranks(tmp_path, source: str) -> list[str]:
    """``source`` run by torchrun on 2 ranks; the lines the ranks printed, sorted."""
    script = tmp_path / "script.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return sorted(done.stdout.splitlines())


def test_leaving_the_group_ends_its_threads_when_torch_dynamo_came_after_it(tmp_path, clean_env):
    # the group had threads while it lived, and none is left once it is left
    assert _two_ranks(tmp_path, SCRIPT) == ["rank 0 gloo threads: True -> []", "rank 1 gloo threads: True -> []"]


# Two backends in one process, as a Trainer script has (its arguments' and its Accelerator's): the first
# forms the group, the second joins it and runs the collectives, with their hang monitor. Leaving the group
# must end every monitor thread of the process, not only the leaving backend's: a monitor thread left
# inside a store call when the interpreter finalizes aborts the process ("terminate called without an
# active exception", exit 134; seen once in a fresh-clone run of a Trainer test).
TWO_BACKENDS = r'''
import os
import threading
import torch
from xshard.backends import get_backend

def monitors():
    return sorted(t.name for t in threading.enumerate() if t.name == "xshard-collective-monitor")

first = get_backend("cpu")
first.init_process_group(timeout=60)
second = get_backend("cpu")
second.init_process_group(timeout=60)  # joins the group the first formed
t = torch.ones(2)
second.collectives.all_reduce(t, op="sum")
during = monitors()
first.destroy_process_group()
os.write(1, f"rank {os.environ['RANK']} monitor threads: {len(during)} -> {len(monitors())}\n".encode())
'''


def test_leaving_the_group_ends_every_hang_monitor_of_the_process(tmp_path, clean_env):
    assert _two_ranks(tmp_path, TWO_BACKENDS) == ["rank 0 monitor threads: 1 -> 0", "rank 1 monitor threads: 1 -> 0"]


"""A single-node job's stores (TCPStore: no authentication) listen on 127.0.0.1 only.

The worker, started by `xshard launch`, lists every TCP socket its launcher process (its parent) listens
on, from /proc, and tries to reach each one through this host's non-loopback address.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.distributed import free_port

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc")]

WORKER = r'''
import json, os, socket, sys
import torch.distributed as dist

def listening(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            parts = line.split()
            address, port = parts[1].split(":")
            if parts[3] == "0A" and parts[9] in inodes:  # LISTEN
                found.append((address, int(port, 16)))
    return found

def outward_address():
    # the address this host would send from (no packet is sent)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
        except OSError:
            return None

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    sockets = listening(os.getppid())
    outward = outward_address()
    reached = []
    for _, port in sockets:
        if outward and not outward.startswith("127."):
            try:
                socket.create_connection((outward, port), timeout=2).close()
                reached.append(port)
            except OSError:
                pass
    with open(sys.argv[1], "w") as f:
        json.dump({"sockets": sockets, "outward": outward, "reached": reached,
                   "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])]}, f)
dist.barrier()
dist.destroy_process_group()
'''

_LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
_LOOPBACK_V6 = "00000000000000000000000001000000"  # ::1


@pytest.mark.parametrize("port_option", [[], ["--master_port", "given"]], ids=["free port", "--master_port"])
def test_a_single_node_jobs_stores_listen_on_loopback_only(tmp_path, clean_env, port_option):
    script, out = tmp_path / "worker.py", tmp_path / "sockets.json"
    script.write_text(WORKER)
    options = [str(free_port()) if o == "given" else o for o in port_option]
    proc = subprocess.run([sys.executable, "-m", "xshard", "launch", "--nproc", "2", *options, str(script), str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(out.read_text())
    ports = {port for _, port in found["sockets"]}
    assert found["master"][1] in ports  # the store the ranks share is the launcher's
    assert found["master"][0] == "127.0.0.1"
    if options:
        assert int(options[1]) in ports  # the rendezvous store on the port the user gave
    assert len(found["sockets"]) >= 2, found  # the rendezvous store and the ranks' store
    assert all(address in (_LOOPBACK_V4, _LOOPBACK_V6) for address, _ in found["sockets"]), found
    assert found["reached"] == [], f"reachable from {found['outward']}: {found['reached']}"

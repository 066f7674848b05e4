"""Two "nodes" on one machine: two network namespaces joined by a veth pair, each with its own host name.

``two_nodes()`` (a context manager) makes them, or calls ``pytest.skip`` with the reason when this machine
cannot (not root, no ``ip``, no namespaces). ``nodes.command(n, argv)`` is ``argv`` run on node ``n``
(``ip netns exec`` into its namespace, ``unshare --uts`` to give it the host name ``xnode<n>``, so that a
rank there is on another host for its peers; ``GLOO_SOCKET_IFNAME`` names its end of the link, as on a
cluster whose host names do not resolve to the interface the nodes share). ``nodes.cut()`` takes the link down (as a pulled cable:
nothing arrives, nothing closes), ``nodes.mend()`` brings it back. Node 0 is ``nodes.address(0)``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

_SUBNET = "10.231.{}.{}"


class TwoNodes:
    """Two network namespaces joined by a veth pair (see the module docstring)."""

    def __init__(self, tag: str) -> None:
        self.names = [f"xs{tag}n0", f"xs{tag}n1"]
        self.links = [f"xs{tag}v0", f"xs{tag}v1"]
        self.subnet = int(tag) % 250 + 1

    def address(self, node: int) -> str:
        """Node ``node``'s address on the link."""
        return _SUBNET.format(self.subnet, node + 1)

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run on node ``node``, under the host name ``xnode<node>``."""
        return ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "env",
                f"GLOO_SOCKET_IFNAME={self.links[node]}", "sh", "-c", f'hostname xnode{node} && exec "$@"', "sh", *argv]

    def cut(self) -> None:
        """Take the link down: packets stop both ways, no connection is closed."""
        _ip("-n", self.names[1], "link", "set", self.links[1], "down")

    def mend(self) -> None:
        """Bring the link back up."""
        _ip("-n", self.names[1], "link", "set", self.links[1], "up")

    def _make(self) -> None:
        for name in self.names:
            _ip("netns", "add", name)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for node, (name, link) in enumerate(zip(self.names, self.links, strict=True)):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{self.address(node)}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def _remove(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_nodes() -> Iterator[TwoNodes]:
    """Two joined namespaces for the block (removed after it); skips the test where this machine cannot."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("two nodes need the `ip` and `unshare` commands (iproute2, util-linux)")
    if os.geteuid() != 0:
        pytest.skip("two nodes need network namespaces, which only root can make")
    nodes = TwoNodes(str(os.getpid() % 100000))
    try:
        nodes._make()
    except subprocess.CalledProcessError as exc:
        nodes._remove()
        pytest.skip(f"this machine cannot make network namespaces joined by a veth pair: {exc.stderr.strip()}")
    try:
        probe = subprocess.run(nodes.command(1, ["true"]), capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"this machine cannot give a namespace its own host name: {probe.stderr.strip()}")
        yield nodes
    finally:
        nodes._remove()

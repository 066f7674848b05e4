"""A multi-node launcher's link to node 0's store gives up when node 0 stops acknowledging.

torchrun's agent talks to the job's store (on node 0) through a TCPStore client. When node 0 is lost for
good (down, or the network cut), a call in flight never returns: the client waits for its answer with no
limit (measured on two network namespaces with the link taken down: still waiting after 170 s). A node
whose ranks failed then restarts them (``--max_restarts``) into a rendezvous that waits on that store,
and its launcher hangs with no word. So the launcher sets ``TCP_USER_TIMEOUT`` on its connections to the
store's port: the kernel ends a connection whose data went unacknowledged that long, the call fails, and
the launcher exits naming the lost node. An idle connection is untouched (the option counts only while
data waits for its acknowledgement), and a link cut for less than that long recovers as before.

Linux only (``/proc``, ``TCP_USER_TIMEOUT``); elsewhere ``StoreLinkGuard`` does nothing.
"""

from __future__ import annotations

import os
import socket
import threading

#: seconds without an acknowledgement after which a connection to node 0's store counts as lost
#: (``--join_timeout`` replaces it)
DEFAULT_SECONDS = 60.0
_SCAN_S = 0.5


class StoreLinkGuard:
    """While running, sets ``TCP_USER_TIMEOUT`` (``seconds``) on this process's connections to ``port``
    (see the module docstring); ``guarded`` counts them."""

    def __init__(self, port: int, seconds: float = DEFAULT_SECONDS) -> None:
        self.port = int(port)
        self.milliseconds = int(seconds * 1000)
        #: connections guarded so far (0: this process never reached the store)
        self.guarded = 0
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xshard-store-link", daemon=True)

    def __enter__(self) -> StoreLinkGuard:
        if hasattr(socket, "TCP_USER_TIMEOUT") and os.path.isdir("/proc/self/fd"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * _SCAN_S)

    def _run(self) -> None:
        while not self._stop.wait(_SCAN_S):
            try:
                self.scan()
            except OSError:  # /proc unreadable: nothing to guard with
                return

    def scan(self) -> None:
        """Guard the connections to the store's port opened since the last scan."""
        inodes = _connections_to(self.port) - self._seen
        if not inodes:
            return
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in inodes:
                try:
                    with socket.socket(fileno=os.dup(int(fd))) as sock:  # the same connection, another fd
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, self.milliseconds)
                except OSError:
                    continue
                self._seen.add(inode)
                self.guarded += 1


def _connections_to(port: int) -> set[str]:
    """The socket inodes of this network namespace's TCP connections whose remote port is ``port``."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and int(cols[2].rsplit(":", 1)[1], 16) == port and cols[3] == "01":  # ESTABLISHED
                inodes.add(cols[9])
    return inodes

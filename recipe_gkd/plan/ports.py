"""Free TCP ports for rendezvous (torch.distributed) that nobody else is handed meanwhile.

Binding port 0 returns a port from the kernel's ephemeral range, which the kernel hands out
again at once to any outgoing connection (Ray opens many): by the time torch.distributed
listens on it, it may be taken (EADDRINUSE, seen in CI). Ports picked at random below the
ephemeral range (Linux default 32768-60999) are never handed out implicitly.
"""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack

LOW_PORT = 20000
HIGH_PORT = 32000  # exclusive; below /proc/sys/net/ipv4/ip_local_port_range's default start
MAX_TRIES = 1000


def reserve_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that are bindable on `host` now and outside the ephemeral range."""
    rng = random.Random()  # seeded from os.urandom: concurrent processes pick different ports
    chosen: list[int] = []
    with ExitStack() as stack:
        for _ in range(MAX_TRIES):
            if len(chosen) == count:
                return chosen
            port = rng.randrange(LOW_PORT, HIGH_PORT)
            if port in chosen:
                continue
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind((host, port))
            except OSError:
                continue
            chosen.append(port)
    if len(chosen) == count:
        return chosen
    raise RuntimeError(f"found only {len(chosen)} of {count} free ports in [{LOW_PORT}, {HIGH_PORT}) on {host}")

"""Free TCP ports, chosen the one way every process of skyrl chooses them.

Standard library only: the launch plan (engine, router and rendezvous ports), a trainer started
without torchrun (its MASTER_PORT) and the tests all use ``find_free_ports``.
"""

from __future__ import annotations

import errno
import random
import resource
import socket
from pathlib import Path

from skyrl_contracts.errors import UsageError

PORT_FLOOR = 10000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_floor(path: str = EPHEMERAL_RANGE_FILE) -> int:
    """The lowest port the kernel assigns automatically (Linux default range 32768-60999)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that are free right now (all held open together while choosing).

    Chosen below the kernel's ephemeral range when it leaves room: the processes of a run start one
    after another over tens of seconds, and meanwhile any outgoing connection (health checks, vLLM's
    own sockets) may be given an ephemeral port as its local end. A port picked from that range was
    taken that way once before vllm-router bound it ("Address already in use" in a CI run).
    """
    low = ephemeral_port_floor()
    candidates = list(range(PORT_FLOOR, low)) if low - PORT_FLOOR >= 4 * n else []
    random.SystemRandom().shuffle(candidates)
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # no room below the ephemeral range: let the kernel choose
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    except OSError as err:
        if err.errno != errno.EMFILE:
            raise
        # Every port is held by an open socket while choosing: a plan with many engines needs as many files.
        raise UsageError(
            f"{n} free ports are needed at once, more than this process may open "
            f"(open-file limit, ulimit -n {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
        ) from None
    finally:
        for s in socks:
            s.close()

"""Where the ranks meet: the rendezvous host a launch names, and whether that name resolves (a DNS lookup)."""

from __future__ import annotations

import socket

from core.env import Launch


def main_address(launch: Launch) -> str | None:
    """The rendezvous host the ranks will connect to: ``MASTER_ADDR``, else (SLURM) the first node of the job."""
    if launch.master_addr is not None:
        return launch.master_addr
    if launch.launcher == "slurm" and launch.hosts:
        return launch.hosts[0]
    return None


def resolves(host: str) -> bool:
    """True when ``host`` has an address (the check c10d's rendezvous would otherwise retry forever)."""
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return False
    return True

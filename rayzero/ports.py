"""Free TCP ports: the one helper every part of rayzero, its tests, benches and scripts use.

A port is found by binding port 0 and reading what the kernel chose; the socket is closed before the
port is used, so another process could take it in between (the usual race of this idiom; callers
that start a server retry or fail loudly). `free_ports(n)` holds all n sockets open together, so
the n ports are distinct.

[Note: ports below the ephemeral range]
A port the kernel picks for port 0 comes from its ephemeral range, the same range it takes the local
end of every outgoing connection from. A port that is bound again only later (a run's MASTER_PORT:
chosen on rank 0's node, then bound by rank 0's TCPStore once every worker got its environment;
the tests' apiserver, given up and rebound by a restart) can meanwhile become some connection's
local port: on a busy machine (Ray's and gRPC's own connections) that happened, and the ranks then
failed to form their group ("The server socket has failed to listen", a rank's TCPStore client
answered by another process's socket) and the run spent a restart on it. `server_port` picks below
that range and above Ray's worker ports (10002-19999), where nothing gets a port without asking for
it by number.
"""
from __future__ import annotations

import pathlib
import random
import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` (loopback by default; "" for every interface)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on `host` (loopback by default; "" for every interface)."""
    return free_ports(1, host)[0]


def server_port(host: str = "127.0.0.1") -> int:
    """A free port on `host` for a server bound later, below the kernel's ephemeral range
    ([Note: ports below the ephemeral range]); any free port where the range leaves no room."""
    return server_ports(1, host)[0]


def server_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports on `host` for servers bound later, as `server_port` picks them (each
    probe is held until all are chosen, so no port is picked twice)."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.Random()
    probes: list[socket.socket] = []
    try:
        for _ in range(100 * count if low > 20000 + count else 0):
            if len(probes) == count:
                break
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                probe.bind((host, chooser.randrange(20000, low)))
            except OSError:  # taken, or one of ours already
                probe.close()
                continue
            probes.append(probe)
        if len(probes) < count:
            return free_ports(count, host)
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()

"""Free TCP ports: the one helper every part of rayzero, its tests, benches and scripts use.

A port is found by binding port 0 and reading what the kernel chose; the socket is closed before the
port is used, so another process could take it in between (the usual race of this idiom; callers
that start a server retry or fail loudly). `free_ports(n)` holds all n sockets open together, so
the n ports are distinct.
"""
from __future__ import annotations

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

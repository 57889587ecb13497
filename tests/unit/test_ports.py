"""[Note: ports below the ephemeral range]: a server's port chosen ahead of its bind comes from below
the kernel's ephemeral range (read from /proc, the kernel's own setting), so no process's outgoing
connection is given it in between."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rayzero.ports import free_port, server_port, server_ports

pytestmark = pytest.mark.unit


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_a_server_port_is_below_the_ephemeral_range_and_above_rays_worker_ports_and_bindable():
    low = _ephemeral_low()
    if low <= 20001:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    ports = {server_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports), (sorted(ports), low)
    assert len(ports) > 1  # chosen at random, not one fixed port every run would contend for
    for host in ("127.0.0.1", ""):
        port = server_port(host)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind((host, port))


def test_server_ports_are_distinct_below_the_ephemeral_range_and_all_bindable_together():
    low = _ephemeral_low()
    if low <= 20009:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    for _ in range(50):  # a pick that repeated a port would show in some round
        ports = server_ports(8)
        assert len(set(ports)) == 8 and all(20000 <= port < low for port in ports), (ports, low)
    servers = [socket.create_server(("127.0.0.1", port)) for port in server_ports(8)]
    for server in servers:
        server.close()


def test_a_port_zero_port_comes_from_the_ephemeral_range_the_one_outgoing_connections_use():
    # what server_port avoids: free_port's kernel-chosen port is from the range connections take theirs from
    low = _ephemeral_low()
    assert free_port() >= low
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        assert client.getsockname()[1] >= low

"""An emulated multi-node cluster on one machine: network namespaces joined by rate-limited links.

[Note: emulated nodes]
Each node is a network namespace `<prefix>n<i>` with one interface, `emu`, address 10.77.0.<i+1>/24:
one end of a veth pair whose other end (`n<i>`) is a port of a bridge in a switch namespace
`<prefix>sw`. Nothing is added to the machine's own namespace (the veths are made there for a moment
and moved), so what the cluster does never touches the host's interfaces, and deleting the
namespaces deletes every veth and qdisc with them. A packet from node a to node b leaves a's `emu`
(shaped: a's uplink), crosses the bridge and enters b through the switch's port `n<b>` (shaped:
b's downlink), so each node has a full-duplex link of the configured rate, as a cloud VM's NIC has.
Traffic between two processes of one node goes to the node's own address, which Linux routes over
the namespace's loopback: it never reaches `emu`, is not shaped and is not counted on the link.
gloo takes its interface from GLOO_SOCKET_IFNAME (`emu` on every node); without it gloo would use
the hostname's address, which `ip netns` does not change (127.0.0.1 here, every namespace alike).

Shaping: `tbf` for the rate on both ends of every link (the kernel here has sch_tbf and sch_htb);
the one-way delay is `netem` on each node's uplink, where the kernel has sch_netem. This machine's
kernel (6.18, CONFIG_NET_SCH_NETEM not set, nor sch_fq for a BPF departure-time delay) has none:
there the link keeps the veth's own latency (tens of microseconds) and `Support.delay` says so.
Queues hold 50 ms at the rate: a drop would stall a TCP stream for its 200 ms minimum RTO, which is
no cloud link's behaviour; `link_counters` reports drops, which should stay 0.

The qdiscs' byte counters (`tc -s qdisc`) are an independent count of inter-node traffic: every
byte that crosses between nodes leaves exactly one uplink and enters exactly one downlink. They
count frames (Ethernet + IP + TCP headers: ~4.6% over the payload at MTU 1500) and the reverse
direction's ACKs (~2% of a bulk stream's volume).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

IFNAME = "emu"
"""The node's interface inside every node namespace (GLOO_SOCKET_IFNAME)."""
SUBNET = "10.77.0"
"""Every cluster has its own switch, so every cluster can use the same addresses."""
_QUEUE_S = 0.05  # see the module note: deep enough that TCP never sees a drop
_NAME = re.compile(r"^rz(\d+)x(\d+)(?:sw|n\d+|probe)$")
_counter = itertools.count()


class Refused(RuntimeError):
    """This machine cannot make the emulated cluster; the message says exactly what was refused."""


@dataclass(frozen=True)
class Link:
    """One node's link to the switch, both directions alike."""

    rate_mbit: float = 1000.0
    """Line rate in Mbit/s (each direction)."""
    delay_ms: float = 0.5
    """One-way delay added on the way out of every node (netem), where the kernel can."""
    mtu: int = 1500

    def burst_bytes(self) -> int:
        # tbf lets `burst` bytes through at once: one 64 KiB GSO frame at least (tbf would cut bigger
        # ones into MTU frames), and ~0.5 ms of line time at high rates, so the token timer need not
        # fire more often than that. At 1 Gbit/s: 64 KiB (0.52 ms).
        return max(64 * 1024 + 2 * self.mtu, int(self.rate_mbit * 1e6 / 8 * 0.0005))

    def queue_bytes(self) -> int:
        return int(self.rate_mbit * 1e6 / 8 * _QUEUE_S) + self.burst_bytes()


@dataclass(frozen=True)
class Support:
    """What this machine allows (`probe()`)."""

    namespaces: bool
    reason: str = ""
    """Why not, when `namespaces` is False: the command and what it answered."""
    delay: bool = False
    """True where sch_netem exists, so `Link.delay_ms` is emulated."""
    delay_reason: str = ""


def _run(argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def probe() -> Support:
    """Whether network namespaces, veths, a bridge and tbf work here, and whether netem does; a
    throwaway namespace is made and deleted."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return Support(False, f"`{tool}` is not installed (Debian: apt-get install iproute2)")
    if os.geteuid() != 0 and not _has_capabilities():
        return Support(False, f"not root (uid {os.geteuid()}) and without CAP_NET_ADMIN and CAP_SYS_ADMIN: "
                              "`ip netns add` needs both (it mounts under /run/netns)")
    name = f"rz{os.getpid()}x{next(_counter)}probe"
    try:
        steps = [["ip", "netns", "add", name],
                 ["ip", "-n", name, "link", "add", "name", "probea", "type", "veth", "peer", "name", "probeb"],
                 ["ip", "-n", name, "link", "add", "name", "probebr", "type", "bridge"],
                 ["tc", "-n", name, "qdisc", "add", "dev", "probea", "root", "tbf", "rate", "1gbit", "burst", "64kb",
                  "latency", "50ms"]]
        for argv in steps:
            done = _run(argv, check=False)
            if done.returncode != 0:
                return Support(False, f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
        netem = _run(["tc", "-n", name, "qdisc", "add", "dev", "probeb", "root", "netem", "delay", "1ms"], check=False)
        if netem.returncode == 0:
            return Support(True, delay=True)
        return Support(True, delay=False, delay_reason=(
            f"`tc qdisc add ... netem` failed: {netem.stderr.strip()} (this kernel has no sch_netem, and no sch_fq "
            "for a BPF departure-time delay): links keep the veth's own latency; rate shaping (tbf) works"))
    finally:
        _run(["ip", "netns", "del", name], check=False)


def _has_capabilities() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
            return bool(effective & (1 << 12)) and bool(effective & (1 << 21))  # NET_ADMIN, SYS_ADMIN
    return False


@dataclass
class NetCluster:
    """`nodes` namespaces on one switch (see [Note: emulated nodes]); `up()` makes them, `down()`
    deletes them and ends every process still inside them. A context manager."""

    nodes: int
    link: Link = field(default_factory=Link)
    prefix: str = ""
    delay_emulated: bool = False
    """Set by `up()`: whether `link.delay_ms` is in force (netem) or only asked for."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 99:
            raise ValueError(f"nodes={self.nodes}: an emulated cluster has 1 to 99 nodes")
        self.prefix = self.prefix or f"rz{os.getpid()}x{next(_counter)}"

    # ---- names --------------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def node_of_address(self, address: str) -> int | None:
        """The node index of an emulated address, None for any other."""
        head, _, last = address.rpartition(".")
        return int(last) - 1 if head == SUBNET and last.isdigit() and 1 <= int(last) <= self.nodes else None

    def describe(self) -> dict:
        """What a process elsewhere needs to read this cluster's counters (`from_description`)."""
        return {"nodes": self.nodes, "link": asdict(self.link), "prefix": self.prefix,
                "delay_emulated": self.delay_emulated}

    @classmethod
    def from_description(cls, description: dict) -> NetCluster:
        return cls(description["nodes"], Link(**description["link"]), description["prefix"],
                   description["delay_emulated"])

    def exec_argv(self, node: int, argv: list[str]) -> list[str]:
        """`argv` run inside node `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> NetCluster:
        support = probe()
        if not support.namespaces:
            raise Refused(support.reason)
        sweep_orphans()
        self.delay_emulated = support.delay and self.link.delay_ms > 0
        try:
            _run(["ip", "netns", "add", self.switch])
            _quiet_ipv6(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", "name", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for node in range(self.nodes):
                self._add_node(node)
        except BaseException:
            self.down()
            raise
        return self

    def _add_node(self, node: int) -> None:
        ns, outer, inner = self.namespace(node), f"{self.prefix}a{node}", f"{self.prefix}b{node}"
        link = self.link
        _run(["ip", "netns", "add", ns])
        _quiet_ipv6(ns)
        _run(["ip", "link", "add", "name", inner, "mtu", str(link.mtu), "type", "veth", "peer", "name", outer,
              "mtu", str(link.mtu)])
        _run(["ip", "link", "set", inner, "netns", ns])
        _run(["ip", "link", "set", outer, "netns", self.switch])
        _run(["ip", "-n", ns, "link", "set", inner, "name", IFNAME])
        _run(["ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", IFNAME])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        _run(["ip", "-n", self.switch, "link", "set", outer, "name", f"n{node}"])
        _run(["ip", "-n", self.switch, "link", "set", f"n{node}", "master", "br0", "up"])
        rate = ["tbf", "rate", f"{link.rate_mbit}mbit", "burst", str(link.burst_bytes()),
                "limit", str(link.queue_bytes())]
        if self.delay_emulated:  # netem holds each frame delay_ms, then tbf paces it out
            _run(["tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "netem", "delay",
                  f"{link.delay_ms}ms", "limit", "100000"])
            _run(["tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "parent", "1:1", "handle", "10:", *rate])
        else:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", *rate])
        _run(["tc", "-n", self.switch, "qdisc", "add", "dev", f"n{node}", "root", "handle", "1:", *rate])

    def down(self) -> None:
        """End every process inside the cluster's namespaces, then delete them (and with them the
        veths and qdiscs). Safe to call twice, and after a failed `up()`."""
        names = [self.namespace(node) for node in range(self.nodes)] + [self.switch]
        end_processes(names)
        for name in names:
            _run(["ip", "netns", "del", name], check=False)

    # ---- counters -----------------------------------------------------------------------------
    def link_counters(self) -> dict[str, dict[str, int]]:
        """Per node (`"n0"`, ...): bytes/packets/drops out of the node (`up_*`, its `emu` uplink's
        root qdisc) and into it (`down_*`, the switch port's root qdisc); `"total"` sums them
        (`up_bytes` there = all inter-node bytes). Read with `tc -s`, from any namespace."""
        out: dict[str, dict[str, int]] = {}
        total = {"up_bytes": 0, "up_packets": 0, "up_drops": 0, "down_bytes": 0, "down_packets": 0, "down_drops": 0}
        for node in range(self.nodes):
            row = {}
            for side, ns, dev in (("up", self.namespace(node), IFNAME), ("down", self.switch, f"n{node}")):
                stats = _root_qdisc(ns, dev)
                row.update({f"{side}_bytes": stats["bytes"], f"{side}_packets": stats["packets"],
                            f"{side}_drops": stats["drops"]})
            out[f"n{node}"] = row
            for key in total:
                total[key] += row[key]
        out["total"] = total
        return out

    def loopback_bytes(self) -> dict[str, int]:
        """Per node, bytes sent over the node's loopback (intra-node traffic: gloo between the
        node's ranks, and Ray's own local traffic)."""
        out = {}
        for node in range(self.nodes):
            shown = json.loads(_run(["ip", "-n", self.namespace(node), "-s", "-j", "link", "show", "lo"]).stdout)
            out[f"n{node}"] = int(shown[0]["stats64"]["tx"]["bytes"])
        return out


def cpu_seconds(namespaces: list[str]) -> float:
    """CPU seconds (user + system) of the processes now in `namespaces`, with the children they
    reaped (a raylet reaps its workers): what a run cost, whatever else loads the machine."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for name in namespaces:
        for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return total / ticks


def counter_delta(after: dict, before: dict) -> dict:
    """`after - before` for two `link_counters()` (or `loopback_bytes()`) readings."""
    if isinstance(after, dict):
        return {key: counter_delta(value, before[key]) for key, value in after.items()}
    return after - before


def _quiet_ipv6(namespace: str) -> None:
    """IPv6 off in a new namespace: its link-local chatter (router solicitations, MLD) would add
    frames to the link counters that no rank sent."""
    _run(["ip", "netns", "exec", namespace, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
          "net.ipv6.conf.default.disable_ipv6=1"])


def _root_qdisc(namespace: str, device: str) -> dict[str, int]:
    shown = json.loads(_run(["tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", device]).stdout)
    root = next(q for q in shown if q.get("root"))
    return {"bytes": int(root["bytes"]), "packets": int(root["packets"]), "drops": int(root["drops"])}


def end_processes(namespaces: list[str], grace_s: float = 5.0) -> None:
    """SIGTERM every process in `namespaces` (`ip netns pids`), then SIGKILL what is left."""
    def pids() -> set[int]:
        found: set[int] = set()
        for name in namespaces:
            done = _run(["ip", "netns", "pids", name], check=False)
            found.update(int(p) for p in done.stdout.split() if p.isdigit())
        return found - {os.getpid()}

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        alive = pids()
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = pids()
        if not alive:
            return


def sweep_orphans() -> list[str]:
    """Delete the namespaces this module made in processes that are gone (a killed test run),
    ending the processes still in them. Returns their names."""
    swept = []
    done = _run(["ip", "netns", "list"], check=False)
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            end_processes([name], grace_s=1.0)
            _run(["ip", "netns", "del", name], check=False)
            swept.append(name)
    return swept


def main() -> None:
    """`probe`: what this machine allows. `check`: make a cluster, measure its links with plain gloo
    (bench/netcluster_gloo.py), delete it. `up`: make a cluster with a Ray node per namespace and keep
    it until Ctrl-C (prints how to reach it)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("command", choices=("probe", "check", "up"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--delay-ms", type=float, default=0.5)
    parser.add_argument("--megabytes", type=float, default=16.0)
    args = parser.parse_args()
    if args.command == "probe":
        print(json.dumps(asdict(probe()), indent=1))
        return
    cluster = NetCluster(args.nodes, Link(args.rate_mbit, args.delay_ms))
    if args.command == "check":
        from bench.netcluster_gloo import measure

        with cluster:
            out = {"cluster": cluster.describe(),
                   "across_nodes": measure(cluster, [1, 1] + [0] * (args.nodes - 2), args.megabytes),
                   "within_a_node": measure(cluster, [2] + [0] * (args.nodes - 1), args.megabytes)}
        print(json.dumps(out, indent=1))
        return
    from bench.netcluster_ray import RayOnNet

    with cluster, RayOnNet(cluster, workers_per_node=args.ranks_per_node) as ray_cluster:
        print(f"emulated cluster up: {args.nodes} Ray nodes at {SUBNET}.1..{args.nodes}, head {ray_cluster.address}\n"
              f"a driver:  ip netns exec {cluster.namespace(0)} env RAY_ADDRESS={ray_cluster.address} "
              f"RAY_AUTH_MODE=token GLOO_SOCKET_IFNAME={IFNAME} python your_driver.py\n"
              f"counters:  tc -n {cluster.namespace(0)} -s qdisc show dev {IFNAME}\nCtrl-C ends it", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()

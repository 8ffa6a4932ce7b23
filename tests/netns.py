"""Several "hosts" on one machine, for multi-host tests: network namespaces joined by
bridges (root only, as in CI).

A :class:`Topology` has *networks* (a bridge each, in the host's namespace, with no
address there) and *nodes* (a network namespace each, with a veth pair per network it
is on and an address from that network's range). Every process of a node is started
in its namespace (``nsenter --net``, :meth:`Node.argv`): it sees only the node's links and
its own loopback.

Traffic stays on the machine (FACTS.md, "Network safety for tests"): the whole range
of a run (a private /24 picked at random among free ones) is an ``unreachable`` route
in the host's namespace for as long as the run lasts, and the host's namespace never
has an address in it.

A *partition* takes a node's link to one network down (its bridge port): packets in
flight and to come are dropped, both ways, as when a cable or a switch port fails;
open TCP connections hang rather than reset. :meth:`Topology.heal` brings it back.

:meth:`Topology.close` (and leaving :func:`topology`) tears everything down, failure or
not: every process running in a node's namespace (those started here and whatever they
forked), the namespaces (and with them their veths), the bridges, the route.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

#: Runs pick their /24 in here.
RANGE = ipaddress.ip_network("10.213.0.0/16")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if subprocess.run(["ip", "-V"], capture_output=True, check=False).returncode != 0:
        return "iproute2 (ip) is not installed"
    return None


def require() -> None:
    """Skip outside CI where namespaces cannot be made; fail in CI (it runs as root)."""
    why = available()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"multi-host tests must run in CI: {why}")
    pytest.skip(why)


@dataclass
class Network:
    name: str
    bridge: str
    subnet: ipaddress.IPv4Network
    hosts: Iterator[ipaddress.IPv4Address]


@dataclass
class Node:
    """A namespace: ``addresses`` maps each network's name to the node's address on it."""

    name: str
    netns: str
    topology: Topology
    addresses: dict[str, str] = field(default_factory=dict)
    #: network name → the veth end on the bridge (in the host's namespace)
    ports: dict[str, str] = field(default_factory=dict)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this node's network namespace. ``nsenter --net`` rather than
        ``ip netns exec``: the latter also mounts a sysfs of its own on /sys, which hides
        /sys/fs/cgroup from the process (a sandbox host needs it); only the network
        namespace changes here, the rest is the host's."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--", *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in this node (``nsenter`` execs it: the pid is the process's)."""
        proc = subprocess.Popen(self.argv(argv), **kw)
        self.topology.processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        kw.setdefault("capture_output", True)
        kw.setdefault("check", True)
        kw.setdefault("timeout", 120)
        return subprocess.run(self.argv(argv), **kw)

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]


#: Topologies made by this process so far (two can be up at once: tags differ).
_made = itertools.count()


class Topology:
    def __init__(self) -> None:
        # Link names are at most 15 characters: "sl" + 5 + a node's name and index.
        self.tag = f"{os.getpid() % 0xFFFF:04x}{next(_made) % 16:x}"
        self.route: str | None = None
        #: The run's /24, kept after :meth:`close` for :meth:`leftovers`.
        self.claimed = ""
        self.networks: dict[str, Network] = {}
        self.nodes: dict[str, Node] = {}
        self.processes: list[subprocess.Popen[Any]] = []
        self._subnets: Iterator[ipaddress.IPv4Network] | None = None

    def _claim_range(self) -> Iterator[ipaddress.IPv4Network]:
        """A /24 of :data:`RANGE` no route of the host's names, made unreachable."""
        taken = _ip("route", "show", "table", "all").stdout
        choices = list(RANGE.subnets(new_prefix=24))
        random.shuffle(choices)
        for subnet in choices:
            prefix = str(subnet.network_address).rsplit(".", 1)[0] + "."
            if prefix in taken:
                continue
            if _ip("route", "add", "unreachable", str(subnet), check=False).returncode == 0:
                self.route = self.claimed = str(subnet)
                return subnet.subnets(new_prefix=26)
        raise RuntimeError(f"no free /24 in {RANGE}")

    def network(self, name: str) -> Network:
        """A bridge with a /26 of the run's range (up to 4 networks a run)."""
        if self._subnets is None:
            self._subnets = self._claim_range()
        subnet = next(self._subnets)
        bridge = f"sl{self.tag}{name}"[:15]
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        net = Network(name, bridge, subnet, subnet.hosts())
        self.networks[name] = net
        return net

    def node(self, name: str, networks: Sequence[str]) -> Node:
        netns = f"sl{self.tag}-{name}"
        _ip("netns", "add", netns)
        node = Node(name, netns, self)
        self.nodes[name] = node
        _ip("-n", netns, "link", "set", "lo", "up")
        for i, net_name in enumerate(networks):
            net = self.networks[net_name]
            port = f"sl{self.tag}{name}{i}"[:15]
            _ip("link", "add", port, "type", "veth", "peer", "name", f"eth{i}", "netns", netns)
            _ip("link", "set", port, "master", net.bridge)
            _ip("link", "set", port, "up")
            address = str(next(net.hosts))
            _ip("-n", netns, "addr", "add", f"{address}/{net.subnet.prefixlen}", "dev", f"eth{i}")
            _ip("-n", netns, "link", "set", f"eth{i}", "up")
            node.addresses[net_name] = address
            node.ports[net_name] = port
        return node

    def partition(self, node: str, network: str) -> None:
        """Cut ``node`` off ``network`` (its bridge port down)."""
        _ip("link", "set", self.nodes[node].ports[network], "down")

    def heal(self, node: str, network: str) -> None:
        _ip("link", "set", self.nodes[node].ports[network], "up")

    def close(self) -> None:
        """Tear everything down (every step tried, whatever failed before)."""
        for node in self.nodes.values():
            for _ in range(50):
                pids = node.pids()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
        for proc in self.processes:
            with contextlib.suppress(Exception):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(10)
        for node in self.nodes.values():
            # Deleting one end of a veth deletes the pair at once; a namespace's own
            # links go with it only when the kernel gets round to it, later.
            for port in node.ports.values():
                _ip("link", "del", port, check=False)
            _ip("netns", "del", node.netns, check=False)
        for net in self.networks.values():
            _ip("link", "del", net.bridge, check=False)
        if self.route is not None:
            _ip("route", "del", "unreachable", self.route, check=False)
        self.nodes.clear()
        self.networks.clear()
        self.route = None

    def leftovers(self) -> list[str]:
        """What of this run still exists (empty after :meth:`close`)."""
        found: list[str] = []
        names = _ip("netns", "list").stdout
        links = _ip("-br", "link").stdout
        routes = _ip("route", "show", "table", "all").stdout
        prefix = f"sl{self.tag}"
        found += [line for line in names.splitlines() if line.startswith(prefix)]
        found += [line for line in links.splitlines() if line.startswith(prefix)]
        if self.claimed:
            found += [line for line in routes.splitlines() if self.claimed in line]
        return found


@contextlib.contextmanager
def topology() -> Iterator[Topology]:
    require()
    topo = Topology()
    try:
        yield topo
    finally:
        topo.close()

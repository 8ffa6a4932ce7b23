"""A multi-host sandlot deployment on one machine, in network namespaces (``tests/netns.py``).

::

    clients ─┐                       front network (HTTP)
     lb ─────┼── r1 ── r2 ── r3 ──   (HAProxy: round robin over the replicas' /readyz,
             │    │     │     │       /replicas/NAME/… to replica NAME's dataplane)
             │   back network (PostgreSQL)
             └── db

- ``db``: PostgreSQL 15 listening on its back-network address;
- ``r1``…``rN``: ``sandlot serve`` replicas on that database, each with its own data
  directory (so its own sandbox host: it runs the sandboxes it creates), on both networks;
- ``lb``: HAProxy, the one address clients know (the token issuer);
- ``clients``: the load generator (``tests/netns_client.py``), driven by the test.

A replica cut from the *back* network has lost its database and nothing else; cut from
the *front* network, the balancer and the clients cannot reach it (nor the sandboxes
it hosts), while it still reaches the database. Sandbox hosts separate from the
brokers are more nodes: :meth:`MultiHost.add_node` makes one on the networks it names,
and :meth:`netns.Node.popen` starts anything in it; :meth:`MultiHost.add_sandbox_host`
starts ``sandlot host`` in a node on both networks (the store on the back one; its
dataplane and provider API on its front address). The sandbox hosts named when the
deployment is made (``hosts=``) are reached through the balancer, as in docs/SCALE.md:
their public URL is ``{balancer}/hosts/NAME`` (HAProxy routes ``/hosts/NAME/dp/`` to
them); the replicas reach their provider API on their own address.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.broker.test_crash_recovery import existing_on_host
from tests.broker.test_e2e import FAST_REAPER
from tests.haproxy import haproxy_config
from tests.netns import Node, Topology, topology
from tests.netns_client import Driver
from tests.pg import _as_postgres, _bin
from tests.servers import ROOT, SandlotServer, isolation_mode, remove_sandboxes

#: Where the replicas listen in their namespaces (each has its own addresses).
PORT = 8765
#: Where ``sandlot host`` nodes listen (dataplane and provider API).
HOST_PORT = 8766
PG_PORT = 5432
LB_PORT = 80


class NodeServer(SandlotServer):
    """``sandlot serve`` in a node, listening on its front-network address."""

    def __init__(self, node: Node, driver: Driver, data_dir: Path, **kw: object) -> None:
        super().__init__(data_dir, **kw)  # type: ignore[arg-type]
        self.node = node
        self.driver = driver
        self.port = PORT

    def command(self, argv: list[str]) -> list[str]:
        return self.node.argv(argv)

    def argv(self) -> list[str]:
        return [*super().argv(), "--host", self.node.addresses["front"]]

    @property
    def own(self) -> str:
        """Its own address (it announces the balancer's, the issuer)."""
        return f"http://{self.node.addresses['front']}:{PORT}"

    def start(self, timeout: float = 30.0) -> NodeServer:
        super().start(timeout)
        self.url, self.port = self.own, PORT
        return self

    def _wait_ready(self, deadline: float) -> None:
        left = max(1.0, deadline - time.monotonic())
        self.driver.call("ready", wait=left + 5, url=f"{self.own}/readyz", timeout=left)


class NodeHost:
    """``sandlot host`` in a node on both networks: the store on the back network, its
    dataplane and provider API on its front-network address. Clients reach its dataplane
    there directly (its public URL), brokers its provider API."""

    def __init__(self, node: Node, driver: Driver, data_dir: Path, **kw: Any) -> None:
        self.node = node
        self.driver = driver
        self.data_dir = data_dir
        self.store: str = kw["store"]
        self.broker_url: str = kw["broker_url"]
        self.capacity: int = kw["capacity"]
        self.config: str = kw["config"]
        self.mode = isolation_mode()
        #: Its own address (its provider API, its health).
        self.url = f"http://{node.addresses['front']}:{HOST_PORT}"
        #: Where clients reach its dataplane: through the balancer, or its own address.
        self.public: str = kw.get("public") or self.url
        self.host_id = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def argv(self) -> list[str]:
        config = self.data_dir.parent / f"{self.data_dir.name}-config.toml"
        config.write_text(self.config)
        argv = [
            *(sys.executable, "-m", "sandlot.cli.main", "host"),
            *("--store", self.store, "--broker-url", self.broker_url),
            *("--listen", f"{self.node.addresses['front']}:{HOST_PORT}"),
            *("--public-url", self.public, "--provider-url", self.url),
            *("--capacity", str(self.capacity), "--data-dir", str(self.data_dir)),
            *("--config", str(config)),
        ]
        return [*argv, "--unisolated"] if self.mode == "unisolated" else argv

    def start(self, timeout: float = 90.0) -> NodeHost:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}
        # Output to a file: the sandboxes it starts would hold a pipe open.
        with self.log.open("ab") as out:
            self.proc = self.node.popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT)
            )
        self.driver.call("ready", wait=timeout + 5, url=f"{self.url}/readyz", timeout=timeout)
        self.host_id = (self.data_dir / "host-id").read_text().strip()
        return self

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        remove_sandboxes(self.data_dir, self.mode)


class Postgres:
    """PostgreSQL in the ``db`` node (``tests/pg.py``'s cluster, on a network address)."""

    def __init__(self, node: Node, subnet: str) -> None:
        initdb, self.pg_ctl = _bin("initdb"), _bin("pg_ctl")
        if initdb is None or self.pg_ctl is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.node = node
        self.base = tempfile.mkdtemp(prefix="sandlot-pg-")
        os.chmod(self.base, 0o755)
        shutil.chown(self.base, "postgres", "postgres")
        self.data = os.path.join(self.base, "data")
        subprocess.run(
            _as_postgres([initdb, "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
            check=True,
            capture_output=True,
        )
        with open(os.path.join(self.data, "pg_hba.conf"), "a") as hba:
            hba.write(f"host all all {subnet} trust\n")
        self.address = node.addresses["back"]
        self.url = f"postgresql://postgres@{self.address}:{PG_PORT}/postgres"

    def start(self) -> None:
        opts = (
            f"-c listen_addresses={self.address} -p {PG_PORT} -k {self.base} -c fsync=off "
            "-c max_connections=400"
        )
        log = os.path.join(self.base, "log")
        self.node.run(
            _as_postgres([self.pg_ctl, "-D", self.data, "-o", opts, "-l", log, "-w", "start"])
        )  # type: ignore[list-item]

    def stop(self, mode: str = "fast") -> None:
        self.node.run(
            _as_postgres([self.pg_ctl, "-D", self.data, "-m", mode, "-w", "stop"]), check=False
        )  # type: ignore[list-item]

    def query(self, sql: str) -> list[list[str]]:
        """Rows of ``sql`` (psql through the cluster's socket)."""
        psql = _bin("psql") or "psql"
        out = self.node.run(
            _as_postgres(
                [
                    psql,
                    "-h",
                    self.base,
                    "-p",
                    str(PG_PORT),
                    "-U",
                    "postgres",
                    "-AtF",
                    "\t",
                    "-c",
                    sql,
                ]
            )
        ).stdout.decode()
        return [line.split("\t") for line in out.splitlines() if line]

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


class MultiHost:
    def __init__(
        self, topo: Topology, base: Path, replicas: int, hosts: tuple[str, ...] = ()
    ) -> None:
        self.topo = topo
        self.base = base
        topo.network("front")
        topo.network("back")
        self.db_node = topo.node("db", ["back"])
        self.lb_node = topo.node("lb", ["front"])
        self.clients = topo.node("clients", ["front"])
        self.names = [f"r{i}" for i in range(1, replicas + 1)]
        for name in self.names:
            topo.node(name, ["front", "back"])
        #: Sandbox hosts behind the balancer (their nodes made now, for its configuration).
        self.host_names = hosts
        for name in hosts:
            topo.node(name, ["front", "back"])
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.driver = Driver(self.clients.argv([]), env=env, cwd=str(ROOT))
        self.lb = f"http://{self.lb_node.addresses['front']}:{LB_PORT}"
        self.pg = Postgres(self.db_node, str(topo.networks["back"].subnet))
        self.replicas: dict[str, NodeServer] = {}
        self.hosts: dict[str, NodeHost] = {}
        self.haproxy: subprocess.Popen[bytes] | None = None

    def add_node(self, name: str, networks: list[str]) -> Node:
        """Another host (a sandbox host, say) on ``networks``."""
        return self.topo.node(name, networks)

    def add_sandbox_host(self, name: str, capacity: int, config: str) -> NodeHost:
        """A ``sandlot host`` node on both networks, started (after :meth:`start`); one
        named in ``hosts`` is reached through the balancer."""
        behind = name in self.host_names
        node = self.topo.nodes[name] if behind else self.add_node(name, ["front", "back"])
        host = NodeHost(
            node,
            self.driver,
            self.base / name,
            store=self.pg.url,
            broker_url=self.lb,
            capacity=capacity,
            config=config,
            public=f"{self.lb}/hosts/{name}" if behind else None,
        )
        self.hosts[name] = host
        return host.start()

    def start(self, settings: str = FAST_REAPER, extra: dict[str, str] | None = None) -> None:
        """``extra``: more variables for every replica (``SANDLOT_SANDBOX_HOSTS``, say)."""
        self.pg.start()
        config = settings + f'\n[server]\nstore_url = "{self.pg.url}"\n'
        for name in self.names:
            env = {
                **(extra or {}),
                "SANDLOT_PUBLIC_URL": self.lb,
                "SANDLOT_DATAPLANE_URL": f"{self.lb}/replicas/{name}",
            }
            self.replicas[name] = NodeServer(
                self.topo.nodes[name], self.driver, self.base / name, config=config, env=env
            )
        self._start_haproxy()
        # The first replica migrates the schema; the others start together.
        first, *rest = self.replicas.values()
        first.start(timeout=90)
        problems: list[BaseException] = []

        def start(srv: NodeServer) -> None:
            try:
                srv.start(timeout=90)
            except BaseException as exc:
                problems.append(exc)

        starters = [threading.Thread(target=start, args=(srv,)) for srv in rest]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if problems:
            raise problems[0]
        self.wait_balanced(set(self.names))

    def _start_haproxy(self) -> None:
        binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
        if binary is None:
            raise RuntimeError(
                "HAProxy is not installed (apt-get install haproxy; scripts/test does)"
            )
        where: dict[str, int | str] = {
            n: f"{self.topo.nodes[n].addresses['front']}:{PORT}" for n in self.names
        }
        hosts = {n: f"{self.topo.nodes[n].addresses['front']}:{HOST_PORT}" for n in self.host_names}
        config = self.base / "haproxy.cfg"
        config.write_text(
            haproxy_config(LB_PORT, where, bind=self.lb_node.addresses["front"], hosts=hosts)
        )
        subprocess.run([binary, "-c", "-q", "-f", str(config)], check=True)
        log = (self.base / "haproxy.log").open("wb")
        self.haproxy = self.lb_node.popen(
            [binary, "-db", "-f", str(config)], stdout=log, stderr=log
        )
        log.close()

    def wait_balanced(self, names: set[str], timeout: float = 60) -> None:
        """Until the balancer has sent a request to each replica in ``names``."""
        from tests.haproxy import REPLICA_HEADER

        seen: set[str] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(AssertionError):
                r = self.driver.call(
                    "request", wait=10, method="GET", url=f"{self.lb}/readyz", timeout=2
                )
                if r["status"] == 200:
                    seen.add(r["headers"].get(REPLICA_HEADER.lower(), ""))
                    if names <= seen:
                        return
            time.sleep(0.05)
        raise AssertionError(f"the balancer never sent requests to all of {names}: {seen}")

    def wait_unbalanced(self, name: str, timeout: float = 60) -> None:
        """Until the balancer's health checks took replica ``name`` out: 2 rounds of
        answers from the others alone."""
        from tests.haproxy import REPLICA_HEADER

        streak = 0
        deadline = time.monotonic() + timeout
        while streak < 2 * len(self.names):
            assert time.monotonic() < deadline, f"the balancer still sends requests to {name}"
            r = self.driver.call("request", wait=30, method="GET", url=f"{self.lb}/readyz")
            streak = streak + 1 if r["headers"].get(REPLICA_HEADER.lower()) != name else 0
            time.sleep(0.05)

    def url(self, name: str) -> str:
        """Replica ``name``'s own address (front network)."""
        return f"http://{self.topo.nodes[name].addresses['front']}:{PORT}"

    def headers(self, user: str, actor: str = "human") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key(user, actor)}"}

    def key(self, user: str, actor: str = "human") -> str:
        return next(iter(self.replicas.values())).key(user, actor)

    def restart(self, name: str) -> None:
        """Start replica ``name`` again (after a kill) and wait until the balancer uses it."""
        srv = self.replicas[name]
        srv.port = PORT
        srv.start(timeout=90)
        self.wait_balanced({name})

    def host_ids(self) -> dict[str, str]:
        return {
            n: (srv.data_dir / "host-id").read_text().strip() for n, srv in self.replicas.items()
        }

    def counts(self, table: str, like: str) -> dict[str, int]:
        """Rows of ``table`` per scope whose key is like ``like``."""
        rows = self.pg.query(
            f"SELECT scope_key, count(*) FROM {table} WHERE scope_key LIKE '{like}' "
            "GROUP BY scope_key"
        )
        return {k: int(n) for k, n in rows}

    def orphans(self, timeout: float = 15) -> dict[str, tuple[set[str], set[str]]]:
        """After a reaper pass of every replica: per replica, (live sandboxes the store says
        it hosts, sandboxes on its host) where they differ; empty when nothing is orphaned."""
        time.sleep(1.0)  # more than one reaper pass (0.3 s)
        hosts = self.host_ids()
        deadline = time.monotonic() + timeout
        while True:
            differ = {}
            for name, srv in self.replicas.items():
                live = {
                    r[0]
                    for r in self.pg.query(
                        "SELECT id FROM sandboxes WHERE state NOT IN ('terminated', 'failed') "
                        f"AND host = '{hosts[name]}'"
                    )
                }
                on_host = existing_on_host(srv.data_dir, srv.mode)
                if live != on_host:
                    differ[name] = (live, on_host)
            for name, host in self.hosts.items():
                live = {
                    r[0]
                    for r in self.pg.query(
                        "SELECT id FROM sandboxes WHERE state NOT IN ('terminated', 'failed') "
                        f"AND host = '{host.host_id}'"
                    )
                }
                on_host = existing_on_host(host.data_dir, host.mode)
                if live != on_host:
                    differ[name] = (live, on_host)
            if not differ or time.monotonic() > deadline:
                return differ
            time.sleep(0.3)

    def close(self) -> None:
        stoppers = [threading.Thread(target=srv.stop) for srv in self.replicas.values()]
        stoppers += [threading.Thread(target=host.stop) for host in self.hosts.values()]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.haproxy.wait(10)
        self.driver.close()
        with contextlib.suppress(Exception):
            self.pg.cleanup()
        for srv in self.replicas.values():
            with contextlib.suppress(Exception):
                srv.cleanup()
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                host.cleanup()


@contextlib.contextmanager
def multihost(
    base: Path,
    replicas: int = 3,
    settings: str = FAST_REAPER,
    extra: dict[str, str] | None = None,
    hosts: tuple[str, ...] = (),
) -> Iterator[MultiHost]:
    """The deployment above, started; everything torn down after (failure or not).
    ``hosts``: sandbox hosts reached through the balancer (started with
    :meth:`MultiHost.add_sandbox_host`)."""
    with topology() as topo:
        cluster = MultiHost(topo, base, replicas, hosts)
        try:
            cluster.start(settings, extra)
            yield cluster
        finally:
            cluster.close()

"""A real HAProxy (Debian's package) in front of ``sandlot serve`` replicas, for tests.

One frontend on a loopback port:

- ``/replicas/NAME/…`` goes to replica ``NAME`` alone, with the prefix taken off: a
  replica's ``dataplane_url`` is ``{balancer}/replicas/NAME``, so a sandbox's dataplane
  traffic (HTTP, WebSockets) crosses the balancer and reaches the host that runs it;
- ``/hosts/NAME/dp/…`` goes to sandbox host ``NAME`` (a ``sandlot host``), with
  ``/hosts/NAME`` taken off: that host's public URL is ``{balancer}/hosts/NAME``, and
  only its dataplane is routed (its provider API is for brokers, on its own address);
- ``/internal/…`` (a replica's provider API, for the other replicas), directly or under
  ``/replicas/NAME``, is refused;
- everything else is balanced round robin over the replicas that pass the health check
  (``GET /readyz``), request by request (keep-alive connections included), so that the
  tests see every request's replica change; with ``sticky``, a client's requests stay
  on the replica that answered its first while that replica is up (a cookie, the set-up
  docs/SCALE.md recommends), and new clients are spread round robin.

HTTP mode throughout: WebSocket upgrades become tunnels (``timeout tunnel``), SSE
responses stream unbuffered. Each response says which replica answered
(``X-Sandlot-Replica``), for the tests to see the spread.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

#: The response header naming the replica that answered.
REPLICA_HEADER = "X-Sandlot-Replica"


def haproxy_config(
    port: int,
    replicas: Mapping[str, int | str],
    bind: str = "127.0.0.1",
    hosts: Mapping[str, str] | None = None,
    sticky: bool = False,
) -> str:
    """The configuration of a balancer on ``bind:port`` over ``replicas`` (name → port on
    loopback, or ``address:port``) and sandbox ``hosts`` (name → ``address:port``)."""
    where = {n: p if isinstance(p, str) else f"127.0.0.1:{p}" for n, p in replicas.items()}
    lines = [
        "global",
        "    maxconn 4096",
        "defaults",
        "    mode http",
        "    option httplog",
        "    timeout connect 2s",
        "    timeout client 120s",
        "    timeout server 120s",
        # A health check's answer may take this long (without it, the check interval:
        # 300 ms, which a replica busy with a storm of requests can exceed).
        "    timeout check 2s",
        # Once upgraded, a WebSocket (an exec stream, a shell) idles as long as it likes.
        "    timeout tunnel 1h",
        "    timeout http-keep-alive 10s",
        # A request whose replica refused the connection (killed) goes to another one.
        "    retries 2",
        "    option redispatch",
        "frontend sandlot",
        f"    bind {bind}:{port}",
    ]
    # The replicas' provider APIs answer the other replicas, not clients.
    lines.append(
        "    http-request deny deny_status 404 if { path_beg /internal/ } "
        "|| { path_reg ^/replicas/[^/]+/internal/ }"
    )
    for name in replicas:
        lines.append(f"    use_backend host_{name} if {{ path_beg /replicas/{name}/ }}")
    for name in hosts or {}:
        lines.append(f"    use_backend sandbox_host_{name} if {{ path_beg /hosts/{name}/dp/ }}")
    lines += [
        "    default_backend replicas",
        "backend replicas",
        "    balance roundrobin",
        *(["    cookie sandlot_replica insert indirect nocache httponly"] if sticky else []),
        "    option httpchk GET /readyz",
        "    http-check expect status 200",
        "    default-server check inter 300ms fall 2 rise 1",
        f"    http-response set-header {REPLICA_HEADER} %[srv_name]",
    ]
    lines += [
        f"    server {name} {a}" + (f" cookie {name}" if sticky else "")
        for name, a in where.items()
    ]
    for name, a in where.items():
        lines += [
            f"backend host_{name}",
            f"    http-request replace-path /replicas/{name}(/.*) \\1",
            f"    http-response set-header {REPLICA_HEADER} {name}",
            f"    server {name} {a}",
        ]
    for name, a in (hosts or {}).items():
        lines += [
            f"backend sandbox_host_{name}",
            f"    http-request replace-path /hosts/{name}(/.*) \\1",
            f"    http-response set-header {REPLICA_HEADER} {name}",
            f"    server {name} {a}",
        ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def haproxy(port: int, replicas: Mapping[str, int], sticky: bool = False) -> Iterator[str]:
    """Run HAProxy on ``127.0.0.1:port`` in front of ``replicas``; yield its URL."""
    binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
    if binary is None:
        pytest.fail("HAProxy is not installed (apt-get install haproxy; scripts/test does)")
    base = Path(tempfile.mkdtemp(prefix="sandlot-haproxy-"))
    config = base / "haproxy.cfg"
    config.write_text(haproxy_config(port, replicas, sticky=sticky))
    subprocess.run([binary, "-c", "-q", "-f", str(config)], check=True)
    log = (base / "log").open("wb")
    proc = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"haproxy did not start:\n{(base / 'log').read_text()}"
                    ) from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(base, ignore_errors=True)

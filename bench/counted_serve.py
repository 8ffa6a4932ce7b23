"""``sandlot serve`` with its round trips counted, for ``bench/k8s_pooled_cost.py``.

Run as ``python bench/counted_serve.py serve …`` (the arguments of ``sandlot serve``).
It counts, from every thread of the server: the requests to the Kubernetes API server
(the official client's urllib3 pool; the watch's stream counts once, when it opens), the
requests to sandboxes' dataplanes (httpx), the SQL statements sent to the store, and
the hops to worker threads (``asyncio.to_thread``/``anyio.to_thread``). On ``SIGUSR1``
it writes them, with the process's CPU time (``time.process_time``, every thread), to
the file named by ``$SANDLOT_COUNTS_FILE`` as one JSON object with a sequence number.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any

import anyio.to_thread
import httpx
import sqlalchemy
import urllib3.connectionpool

COUNTS: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()
_seq = 0

# Names of objects (pods, ConfigMaps) become ``{name}`` so that calls group by kind.
_NAMED = re.compile(r"/(pods|configmaps|persistentvolumeclaims)/[^/?]+")


def _count(key: str) -> None:
    with _lock:
        COUNTS[key] += 1


_urlopen = urllib3.connectionpool.HTTPConnectionPool.urlopen


def _counted_urlopen(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
    path = url.split("?", 1)[0]
    watch = "watch=true" in url or "watch=True" in url
    kind = _NAMED.sub(lambda m: f"/{m.group(1)}/{{name}}", path)
    _count(f"k8s {method} {kind}{' (watch)' if watch else ''}")
    return _urlopen(self, method, url, *args, **kwargs)


_send = httpx.AsyncClient.send


async def _counted_send(self: httpx.AsyncClient, request: httpx.Request, **kwargs: Any) -> Any:
    _count(f"http {request.method} {re.sub(r'/sb_[^/]+', '/{sandbox}', request.url.path)}")
    return await _send(self, request, **kwargs)


_TABLE = re.compile(r"\b(?:FROM|INTO|UPDATE)\s+\"?(\w+)", re.IGNORECASE)


def _on_statement(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
    verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "?"
    table = _TABLE.search(statement)
    _count(f"sql {verb} {table.group(1) if table else ''}".rstrip())


_asyncio_to_thread = asyncio.to_thread
_anyio_run_sync = anyio.to_thread.run_sync


async def _counted_to_thread(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    _count("thread hop")
    return await _asyncio_to_thread(fn, *args, **kwargs)


async def _counted_run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
    _count("thread hop")
    return await _anyio_run_sync(fn, *args, **kwargs)


def _dump(_signum: int, _frame: Any) -> None:
    global _seq
    _seq += 1
    with _lock:
        doc = {"seq": _seq, "cpu": time.process_time(), "counts": dict(COUNTS)}
    path = os.environ["SANDLOT_COUNTS_FILE"]
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def install() -> None:
    urllib3.connectionpool.HTTPConnectionPool.urlopen = _counted_urlopen  # type: ignore[method-assign]
    httpx.AsyncClient.send = _counted_send  # type: ignore[method-assign]
    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", _on_statement)
    asyncio.to_thread = _counted_to_thread
    anyio.to_thread.run_sync = _counted_run_sync
    signal.signal(signal.SIGUSR1, _dump)


if __name__ == "__main__":
    install()
    from sandlot.cli.main import main

    sys.argv = ["sandlot", *sys.argv[1:]]
    main()

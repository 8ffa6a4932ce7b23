"""The clients of a multi-host test, run inside their own network namespace:
``ip netns exec NS python -m tests.netns_client`` (:class:`Driver` starts it).

It reads one JSON request a line on stdin (``{"id", "op", "args"}``), runs each
concurrently, and writes JSON lines on stdout: ``{"id", "event", …}`` while an operation
runs (for the test to inject a fault at the right moment), then ``{"id", "result"}`` or
``{"id", "error"}``. Operations are the ``op_*`` functions below.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import queue
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import httpx

#: Answers a client retries (with the same Idempotency-Key): a balancer's 502/504 (the
#: replica went away mid-request), a 503 (no replica, or BACKEND_UNAVAILABLE).
RETRYABLE = (502, 503, 504)

Emit = Callable[[dict[str, Any]], None]


def _body(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text[:500]


async def op_request(emit: Emit, method: str, url: str, **kw: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=kw.pop("timeout", 30)) as client:
        r = await client.request(method, url, **kw)
    return {"status": r.status_code, "body": _body(r), "headers": dict(r.headers)}


async def op_ready(emit: Emit, url: str, timeout: float = 60) -> dict[str, Any]:
    """Until ``url`` answers 200."""
    started = time.monotonic()
    last = ""
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() - started < timeout:
            try:
                r = await client.get(url)
                if r.status_code == 200:
                    return {"waited": time.monotonic() - started}
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} never answered 200: {last}")


class Tally:
    """What a storm's clients met."""

    def __init__(self) -> None:
        self.answers: collections.Counter[str] = collections.Counter()
        self.retried: collections.Counter[str] = collections.Counter()
        self.server_errors: list[str] = []
        self.retries = 0
        self.gave_up = 0
        self.keyed: list[tuple[str, str, str]] = []  # (key, thread, session) of retried requests


async def _ensure(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    thread: str,
    tally: Tally,
    deadline: float,
) -> dict[str, Any] | None:
    """One ensure, retried with its Idempotency-Key until answered or ``deadline``
    seconds have passed."""
    until = time.monotonic() + deadline
    key = str(uuid.uuid4())
    keyed = {**headers, "Idempotency-Key": key}
    body = {"thread_id": thread, "mode": "ensure"}
    attempt = 0
    while True:
        try:
            r = await client.post(url, json=body, headers=keyed)
        except httpx.HTTPError as exc:
            seen = type(exc).__name__
            r = None
        else:
            seen = str(r.status_code)
            if r.status_code == 200:
                grant: dict[str, Any] = r.json()
                tally.answers["200"] += 1
                if attempt:
                    tally.keyed.append((key, thread, grant["session_id"]))
                return grant
            payload = _body(r)
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            if error.get("code"):
                seen += f" {error['code']}"
            retryable = r.status_code in RETRYABLE and (not error or error.get("retryable"))
            if not retryable:
                tally.answers[seen] += 1
                if r.status_code >= 500:
                    tally.server_errors.append(f"{seen}: {str(payload)[:300]}")
                return None
        tally.retried[seen] += 1
        tally.retries += 1
        attempt += 1
        if time.monotonic() > until:
            tally.gave_up += 1
            return None
        await asyncio.sleep(min(0.05 * 2**attempt, 1.0) * random.uniform(0.5, 1.0))


async def op_storm(
    emit: Emit,
    base: str,
    headers: dict[str, str],
    threads: Sequence[str],
    per_thread: int,
    connections: int = 64,
    deadline: float = 120,
    replays: int = 50,
) -> dict[str, Any]:
    """``per_thread`` concurrent ensures of each thread in turn, through ``base``, each
    retried for up to ``deadline`` seconds; an event after each thread (``{"event":
    "thread", "done": n}``). Then the requests that needed retries are sent again with
    their key: each must be answered with the same binding (replayed)."""
    tally = Tally()
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    per: dict[str, dict[str, list[str]]] = {}
    started = time.monotonic()
    url = f"{base}/v1/sandbox/sessions"
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        for n, thread in enumerate(threads, 1):
            grants = await asyncio.gather(
                *(_ensure(client, url, headers, thread, tally, deadline) for _ in range(per_thread))
            )
            got = [g for g in grants if g is not None]
            per[thread] = {
                "sessions": sorted({g["session_id"] for g in got}),
                "sandboxes": sorted({g["sandbox"]["id"] for g in got}),
                "dataplanes": sorted({g["dataplane"]["http_base_url"] for g in got}),
            }
            emit({"event": "thread", "done": n})
        took = time.monotonic() - started
        mismatched: list[str] = []
        checked = 0
        for key, thread, session in tally.keyed[:replays]:
            r = await client.post(
                url,
                json={"thread_id": thread, "mode": "ensure"},
                headers={**headers, "Idempotency-Key": key},
            )
            checked += 1
            if (
                r.status_code != 200
                or r.json()["session_id"] != session
                or r.headers.get("idempotent-replayed") != "true"
            ):
                mismatched.append(f"{key}: {r.status_code} {r.text[:200]}")
    return {
        "threads": per,
        "answers": dict(tally.answers),
        "retried": dict(tally.retried),
        "retries": tally.retries,
        "gave_up": tally.gave_up,
        "server_errors": tally.server_errors,
        "replays_checked": checked,
        "replays_mismatched": mismatched,
        "seconds": took,
    }


async def op_stream(
    emit: Emit, base: str, key: str, thread: str, producer: str, total: int
) -> dict[str, Any]:
    """Run ``producer total`` through the SDK on ``thread``'s sandbox and read its whole
    output; events: ``dataplane`` (the grant's URL) and ``third`` (a third received)."""
    from sandlot.sdk import AsyncSandlot

    digest = hashlib.sha256()
    received = 0
    out_of_order: list[tuple[int, int]] = []
    async with AsyncSandlot(base, key) as client:
        sandbox = await client.ensure(thread)
        emit(
            {
                "event": "dataplane",
                "url": sandbox.grant.http_base_url,
                "session": sandbox.grant.session_id,
            }
        )
        cmd = await sandbox.stream(["python3", "-c", producer, str(total)])
        told = False
        async for chunk in cmd:
            if chunk.stream != "stdout":
                continue
            if chunk.offset != received:
                out_of_order.append((chunk.offset, received))
            data = chunk.data.encode()
            digest.update(data)
            received += len(data)
            if not told and received >= total // 3:
                told = True
                emit({"event": "third", "received": received})
    return {
        "received": received,
        "sha256": digest.hexdigest(),
        "exit_code": cmd.exit_code,
        "reconnects": cmd.reconnects,
        "out_of_order": out_of_order[:5],
    }


async def op_revoke(
    emit: Emit, releases: list[dict[str, Any]], timeout: float = 10
) -> dict[str, Any]:
    """For each release (``url``: a session at one replica, ``headers``, ``token``,
    ``dataplanes``: URLs answering the token): the token works on every dataplane, the
    session is released (DELETE) at that replica, then each dataplane is polled with the
    token until it refuses it (401). Seconds from the DELETE's answer to each refusal."""
    latencies: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10) as client:

        async def exec_true(dataplane: str, token: str) -> int:
            r = await client.post(
                f"{dataplane}/exec",
                json={"command": "true"},
                headers={"Authorization": f"Bearer {token}"},
            )
            return r.status_code

        for release in releases:
            for dataplane in release["dataplanes"]:
                status = await exec_true(dataplane, release["token"])
                if status != 200:
                    raise AssertionError(f"{dataplane} refused the token before: {status}")
        for release in releases:
            r = await client.delete(release["url"], headers=release["headers"])
            if r.status_code != 204:
                raise AssertionError(f"release at {release['url']}: {r.status_code} {r.text}")
            released = time.monotonic()

            async def refused(dataplane: str, token: str, since: float = released) -> None:
                while time.monotonic() - since < timeout:
                    if await exec_true(dataplane, token) == 401:
                        latencies[dataplane] = time.monotonic() - since
                        return
                    await asyncio.sleep(0.01)

            await asyncio.gather(*(refused(d, release["token"]) for d in release["dataplanes"]))
    return {"latencies": latencies}


async def op_events(
    emit: Emit,
    url: str,
    headers: dict[str, str],
    until: str,
    linger: float = 2.0,
    timeout: float = 120,
) -> dict[str, Any]:
    """Subscribe to a binding's events (``url``: its ``…/events?after=N``); an event
    ``open`` once subscribed; every event up to the first ``until`` and ``linger`` seconds
    after it (a second one would be seen), or until ``timeout`` seconds have passed."""
    events: list[dict[str, Any]] = []
    seen = asyncio.Event()

    async def read(client: httpx.AsyncClient) -> None:
        async with client.stream("GET", url, headers=headers) as resp:
            if resp.status_code != 200:
                raise AssertionError(f"subscribe: {resp.status_code} {(await resp.aread())!r}")
            async for line in resp.aiter_lines():
                if line.startswith(": stream open"):
                    emit({"event": "open"})
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1].get("event_type") == until:
                        seen.set()

    async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=60)) as client:
        reader = asyncio.create_task(read(client))
        waiter = asyncio.create_task(seen.wait())
        await asyncio.wait({reader, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if seen.is_set() and not reader.done():
            await asyncio.wait({reader}, timeout=linger)
        for task in (reader, waiter):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return {"events": events}


OPS: dict[str, Callable[..., Any]] = {
    "events": op_events,
    "request": op_request,
    "ready": op_ready,
    "storm": op_storm,
    "stream": op_stream,
    "revoke": op_revoke,
}


async def serve() -> None:
    loop = asyncio.get_running_loop()
    lock = threading.Lock()

    def write(message: dict[str, Any]) -> None:
        with lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    async def run(request: dict[str, Any]) -> None:
        rid = request["id"]

        def emit(event: dict[str, Any]) -> None:
            write({"id": rid, **event})

        try:
            result = await OPS[request["op"]](emit, **request.get("args", {}))
        except Exception as exc:
            write({"id": rid, "error": f"{type(exc).__name__}: {exc}"})
        else:
            write({"id": rid, "result": result})

    tasks = set()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        task = asyncio.create_task(run(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in tasks:
        task.cancel()


class Call:
    """A running operation of a :class:`Driver`."""

    def __init__(self) -> None:
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._done = threading.Event()
        self._outcome: dict[str, Any] = {}

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if self._done.is_set():
                    self.result(0)
                raise TimeoutError(f"no {name!r} event in {timeout} s") from None
            if event.get("event") == name:
                return event

    def result(self, timeout: float) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"no answer in {timeout} s")
        if "error" in self._outcome:
            raise AssertionError(f"the clients' operation failed: {self._outcome['error']}")
        return self._outcome["result"]


class Driver:
    """The test's side: starts the clients in a namespace (``argv_prefix``, e.g.
    ``ip netns exec NS``), sends operations, dispatches what comes back."""

    def __init__(self, argv_prefix: Sequence[str], env: dict[str, str], cwd: str) -> None:
        self.proc = subprocess.Popen(
            [*argv_prefix, sys.executable, "-m", "tests.netns_client"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.calls: dict[str, Call] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            call = self.calls[message.pop("id")]
            if "event" in message:
                call.events.put(message)
            else:
                call._outcome = message
                call._done.set()
        for call in self.calls.values():
            if not call._done.is_set():
                call._outcome = {"error": "the clients' process ended"}
                call._done.set()

    def start(self, op: str, **args: Any) -> Call:
        rid = uuid.uuid4().hex
        call = self.calls[rid] = Call()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        return call

    def call(self, op: str, wait: float = 120, **args: Any) -> Any:
        """Run ``op`` and return its result (``wait``: at most that many seconds)."""
        return self.start(op, **args).result(wait)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    asyncio.run(serve())

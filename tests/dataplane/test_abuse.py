"""One tenant's worst requests, against a real ``sandlot serve``: nobody else may notice.

A tenant with ``fs_read`` can send patterns whose naive matching takes exponential
time (issue 17: ``**/`` twenty times on a 60-level tree held the interpreter for
minutes and froze every tenant). Here an attacker's sandbox holds a deep tree, a
huge tree and long names, and :data:`ABUSE` lists, per endpoint, the worst requests
found; while attackers send them, ``/healthz`` and another tenant's (another user,
another sandbox, another token) 4 KiB read are timed.

To add the worst cases of another endpoint, add its list to :data:`ABUSE` (and what
its requests need to :data:`SETUP`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.figures import FULL, RecordProperty, report
from tests.servers import SandlotServer, running

CONFIG = """
[policy]
token_ttl_seconds = 7200
"""

#: Depth of the deep tree (issue 17 used 60 levels).
DEPTH = 60
#: Files of the huge tree.
HUGE_FILES = 50_000 if FULL else 20_000  # the default 1 GiB disk holds 65,536 inodes
#: How long the attackers keep going.
DURATION = 60.0 if FULL else 6.0
ATTACKERS = 4
#: What every request of :data:`ABUSE` must answer within: the dataplane's own glob
#: deadline (10 s) and a margin for a loaded 2-core machine.
REQUEST_DEADLINE = 30.0

DEEP = "/workspace/deep/" + "/".join(f"d{i}" for i in range(1, DEPTH + 1))
LONG_NAME = "a" * 250

LEVELS = (1, 10, 30, DEPTH)

#: The deep tree: a .txt and a .md file at a few levels.
DEEP_SETUP = f"""
set -e
mkdir -p {DEEP}
for i in {" ".join(map(str, LEVELS))}; do
  dir=/workspace/deep/$(seq -s / -f d%g 1 $i)
  echo x > "$dir/level$i.txt"; echo x > "$dir/level$i.md"
done
"""

#: ~11 MiB of lower-case words (no digit, nothing outside ASCII): grep's slow patterns
#: below match nothing in them and keep ripgrep busy for seconds per MiB.
WORDS = """
import random
random.seed(7)
words = ["".join(random.choices("abcdefghijklmnopqrstuvwxyz", k=random.randint(1, 10)))
         for _ in range(5000)]
with open("/workspace/words/words.txt", "w") as f:
    for _ in range(150000):
        f.write(" ".join(random.choices(words, k=12)) + "\\n")
"""

#: Run once in the attacker's sandbox: the trees the requests walk.
SETUP = f"""
{DEEP_SETUP}
mkdir -p /workspace/long/{LONG_NAME}
touch /workspace/long/{LONG_NAME}/{LONG_NAME} /workspace/long/{LONG_NAME}b
mkdir -p /workspace/words && python3 -c '{WORDS}'
mkdir -p /workspace/huge && cd /workspace/huge
for d in $(seq 1 100); do
  mkdir -p d$d && (cd d$d && seq -f f%g.txt 1 {HUGE_FILES // 100} | xargs touch)
done
"""

NESTED = "**/" * 20 + "*.txt"
#: Linear for ripgrep, but its lazy DFA gives up on it: ~1 MiB/s, no match in WORDS.
SLOW_REGEX = r"(?:.{0,40}a){10}[^\x00-\x7f]"
#: The grep deadline of the server under test (the default is 30 s).
GREP_DEADLINE = 10
STARS = "*a" * 1000 + "b"  # one name, 1,000 stars, against names of 250 a's
BRACES_ALLOWED = "{a,b}" * 8  # 256 alternatives: the most there may be


@dataclass
class Abuse:
    """One request an attacker repeats; ``statuses``: the answers it may get."""

    name: str
    method: str
    path: str
    body: dict[str, Any] = field(default_factory=dict)
    statuses: tuple[int, ...] = (200,)


#: The worst requests per endpoint.
ABUSE: dict[str, list[Abuse]] = {
    "/glob": [
        Abuse("nested **, deep tree", "POST", "/glob", {"pattern": NESTED, "path": "/workspace"}),
        Abuse(
            "1,300 nested **",
            "POST",
            "/glob",
            {"pattern": "**/" * 1300 + "*.txt", "path": "/workspace/deep"},
        ),
        Abuse("** everything", "POST", "/glob", {"pattern": "**", "path": "/workspace"}),
    ],
    "/fs/glob": [
        Abuse("nested **, deep tree", "POST", "/fs/glob", {"pattern": NESTED}),
        Abuse(
            "**/a/**/a…",
            "POST",
            "/fs/glob",
            {"pattern": "**/d1/**/d1/**/d1/" * 30 + "*"},
        ),
        Abuse("stars in one name", "POST", "/fs/glob", {"pattern": "**/" + STARS}),
        Abuse("stars, names only", "POST", "/fs/glob", {"pattern": STARS}),
        Abuse(
            "256 alternatives of **",
            "POST",
            "/fs/glob",
            {"pattern": "**/" + BRACES_ALLOWED + "/**/" + "*" * 5},
        ),
        Abuse("brace bomb", "POST", "/fs/glob", {"pattern": "{a,b}" * 40}, (400,)),
        Abuse(
            "nested brace bomb",
            "POST",
            "/fs/glob",
            {"pattern": "{" * 1000 + "}" * 1000},
            (200, 400),
        ),
        Abuse("huge tree", "POST", "/fs/glob", {"pattern": "**/*.txt", "path": "/workspace/huge"}),
        Abuse("huge tree, names", "POST", "/fs/glob", {"pattern": "f1*", "path": "/workspace"}),
    ],
    "/fs/grep": [
        Abuse(
            "a{1000}{1000}",
            "POST",
            "/fs/grep",
            {"pattern": "a{1000}{1000}", "regex": True, "path": "/workspace"},
            (400,),
        ),
        Abuse(
            "slow regex to its deadline",
            "POST",
            "/fs/grep",
            {"pattern": SLOW_REGEX, "regex": True, "path": "/workspace/words"},
        ),
        Abuse(
            "every line, case folded",
            "POST",
            "/fs/grep",
            {"pattern": "[a-z]", "regex": True, "ignore_case": True, "path": "/workspace"},
        ),
        Abuse("huge tree", "POST", "/fs/grep", {"pattern": "x", "path": "/workspace/huge"}),
        Abuse(
            "repetitions, deep tree",
            "POST",
            "/fs/grep",
            {"pattern": r"(\w+\s*){1,200}\d", "regex": True, "path": "/workspace/deep"},
        ),
    ],
    "/grep": [
        Abuse(
            "slow regex to its deadline",
            "POST",
            "/grep",
            {"pattern": SLOW_REGEX, "regex": True, "path": "/workspace/words", "limit": 10},
        ),
        Abuse(
            "(?i)\\w{1000}",
            "POST",
            "/grep",
            {"pattern": "(?i)\\w{1000}", "regex": True, "path": "/workspace"},
            (400,),
        ),
    ],
}


@dataclass
class Tenant:
    """A sandbox of its own, reached with its own token."""

    dataplane: str
    headers: dict[str, str]

    def client(self, timeout: float = REQUEST_DEADLINE) -> httpx.Client:
        return httpx.Client(base_url=self.dataplane, headers=self.headers, timeout=timeout)

    def exec(self, command: str, timeout: float = 300) -> dict[str, Any]:
        with self.client(timeout + 30) as c:
            r = c.post("/exec", json={"command": command, "timeout_seconds": timeout})
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        assert out["exit_code"] == 0, out
        return out


def tenant(srv: SandlotServer, user: str, thread: str) -> Tenant:
    headers = {"Authorization": f"Bearer {srv.key(user)}"}
    r = httpx.post(
        f"{srv.url}/v1/sandbox/sessions",
        json={"thread_id": thread, "mode": "ensure"},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    grant = r.json()
    deadline = time.monotonic() + 60
    while True:
        snap = httpx.get(f"{srv.url}/v1/sandbox/sessions/{grant['session_id']}", headers=headers)
        if snap.json()["binding"]["state"] == "active":
            break
        assert time.monotonic() < deadline, snap.text
        time.sleep(0.05)
    return Tenant(
        grant["dataplane"]["http_base_url"], {"Authorization": f"Bearer {grant['token']}"}
    )


def with_4k(t: Tenant) -> Tenant:
    """The file :class:`Prober` reads."""
    with t.client() as c:
        r = c.put("/fs/write", json={"path": "/workspace/4k.bin", "content": "v" * 4096})
        assert r.status_code == 201, r.text
    return t


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandlotServer]:
    env = {"SANDLOT_DP_GREP_TIMEOUT_SECONDS": str(GREP_DEADLINE)}
    with running(tmp_path_factory.mktemp("abuse") / "d", config=CONFIG, env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def attacker(serve: SandlotServer) -> Tenant:
    t = tenant(serve, "mallory", "thr_abuse")
    t.exec(SETUP)
    return t


@pytest.fixture(scope="module")
def victim(serve: SandlotServer) -> Tenant:
    return with_4k(tenant(serve, "alice", "thr_victim"))


class Prober:
    """Times ``/healthz`` and the victim's 4 KiB read, one after the other, until stopped."""

    def __init__(self, serve: SandlotServer, victim: Tenant) -> None:
        self.serve = serve
        self.victim = victim
        self.health: list[float] = []
        self.reads: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=REQUEST_DEADLINE) as health, self.victim.client() as reads:
            while not self.stop.is_set():
                for url, client, into in (
                    (f"{self.serve.url}/healthz", health, self.health),
                    ("/fs/read?path=/workspace/4k.bin", reads, self.reads),
                ):
                    started = time.perf_counter()
                    try:
                        r = client.get(url)
                    except httpx.HTTPError as exc:
                        into.append(time.perf_counter() - started)
                        self.failures.append(f"{url}: {exc!r}")
                        continue
                    into.append(time.perf_counter() - started)
                    if r.status_code != 200:
                        self.failures.append(f"{url}: {r.status_code} {r.text[:200]}")
                time.sleep(0.002)

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(REQUEST_DEADLINE * 2 + 10)


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def send(client: httpx.Client, abuse: Abuse) -> tuple[int | None, float, dict[str, Any] | None]:
    """Send one request: (status or None on a timeout, seconds taken, JSON body)."""
    started = time.perf_counter()
    try:
        r = client.request(abuse.method, abuse.path, json=abuse.body)
    except httpx.TimeoutException:
        return None, time.perf_counter() - started, None
    took = time.perf_counter() - started
    try:
        body = r.json()
    except ValueError:
        body = None
    return r.status_code, took, body


@pytest.mark.timeout(300)
def test_nested_globstar_on_a_deep_tree_answers_and_the_server_stays_up(
    serve: SandlotServer,
) -> None:
    """Issue 17's reproduction: LangSmith ``/glob`` with ``**/`` twenty times over a
    60-level tree. Before, the pattern became a regex that backtracked for minutes
    under the interpreter lock, and ``/healthz`` hung with it."""
    deep = with_4k(tenant(serve, "eve", "thr_deep"))
    deep.exec(DEEP_SETUP)
    with Prober(serve, deep) as prober, deep.client() as c:
        time.sleep(0.2)
        status, took, body = send(c, ABUSE["/glob"][0])
        fs_status, _, fs_body = send(c, ABUSE["/fs/glob"][0])
        time.sleep(0.2)
    assert status == 200 and body is not None, (status, took, body)
    expected = [
        "/workspace/deep/" + "/".join(f"d{i}" for i in range(1, n + 1)) + f"/level{n}.txt"
        for n in LEVELS
    ]
    assert sorted(m["path"] for m in body["matches"]) == sorted(expected)
    assert not body["truncated"]
    assert fs_status == 200 and fs_body is not None
    assert sorted(m["path"] for m in fs_body["matches"]) == sorted(expected)
    assert took < REQUEST_DEADLINE
    assert prober.health and not prober.failures, prober.failures[:5]
    # Generous: proves that /healthz never waited for the glob, not how fast it is.
    assert max(prober.health) < 5, max(prober.health)


@pytest.mark.reliability
@pytest.mark.timeout(600 if FULL else 300)
def test_worst_patterns_do_not_slow_other_tenants(
    serve: SandlotServer,
    attacker: Tenant,
    victim: Tenant,
    record_property: RecordProperty,
) -> None:
    abuses = [a for endpoint in ABUSE.values() for a in endpoint]
    sent: dict[str, int] = {a.name: 0 for a in abuses}
    slowest: dict[str, float] = {a.name: 0.0 for a in abuses}
    wrong: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def attack(k: int) -> None:
        with attacker.client() as c:
            i = k * len(abuses) // ATTACKERS  # each starts elsewhere in the list
            while not stop.is_set():
                abuse = abuses[i % len(abuses)]
                i += 1
                status, took, body = send(c, abuse)
                with lock:
                    sent[abuse.name] += 1
                    slowest[abuse.name] = max(slowest[abuse.name], took)
                    if status not in abuse.statuses:
                        wrong.append(f"{abuse.name}: {status} {str(body)[:300]}")

    with Prober(serve, victim) as prober:
        time.sleep(0.5)  # a few quiet samples first
        threads = [
            threading.Thread(target=attack, args=(k,), daemon=True) for k in range(ATTACKERS)
        ]
        for t in threads:
            t.start()
        time.sleep(DURATION)
        stop.set()
        for t in threads:
            t.join(REQUEST_DEADLINE + 10)
    health, reads = p99(prober.health) * 1000, p99(prober.reads) * 1000
    figure = (
        f"{ATTACKERS} clients x {DURATION:.0f} s of the worst globs and greps "
        f"({sum(sent.values())} requests, slowest {max(slowest.values()):.2f} s): "
        f"/healthz p99 {health:.1f} ms ({len(prober.health)} probes), "
        f"other tenant's 4 KiB read p99 {reads:.1f} ms ({len(prober.reads)} probes)"
    )
    report(record_property, figure)
    assert not wrong, wrong[:10]
    assert not prober.failures, prober.failures[:5]
    assert all(n > 0 for n in sent.values()) or not FULL, sent
    assert max(slowest.values()) < REQUEST_DEADLINE, slowest
    # The bar is 50 ms p99; at CI size (a shared 2-core machine) a looser bound
    # that still fails when one request holds the server.
    bound = 50.0 if FULL else 1000.0
    assert health <= bound and reads <= bound, figure

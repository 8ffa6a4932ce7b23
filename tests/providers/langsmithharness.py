"""Two real ``sandlot serve``: a LangSmith-compatible service (the second, serving
``/v2/sandboxes/boxes`` and each box's ``/execute``, ``/execute/ws``, ``/upload``,
``/download``, ``/glob``, ``/grep``) and a broker whose ``langsmith`` provider creates
its sandboxes there and serves them through its relay. The service's API key is the
provider's key, handed over in a file."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.servers import SandlotServer


@dataclass
class Pair:
    service: SandlotServer
    broker: SandlotServer
    #: The provider's key: an API key of the service.
    service_key: str

    def boxes(self) -> list[dict[str, object]]:
        """The boxes the service holds for the provider's key."""
        r = httpx.get(
            f"{self.service.url}/v2/sandboxes/boxes",
            headers={"X-Api-Key": self.service_key},
            timeout=30,
        )
        r.raise_for_status()
        return list(r.json()["sandboxes"])


def broker_config(
    service_url: str, key_file: Path, *, with_local: bool, reaper_interval: float = 0.5
) -> str:
    """What a user writes: the hosted service as a provider (and the machine's own)."""
    langsmith = f"""
kind = "langsmith"
url = "{service_url}/v2/sandboxes"
api_key_file = "{key_file}"
poll_seconds = 0.05
"""
    if not with_local:
        return f"""
[policy]
reaper_interval_seconds = {reaper_interval}

[provider]
name = "langsmith"
{langsmith.replace('kind = "langsmith"', "")}
"""
    return f"""
default_provider = "local"

[policy]
reaper_interval_seconds = {reaper_interval}

[providers.local]
kind = "local"

[providers.hosted]
{langsmith}

[templates.hosted-only]
image = "host"
provider = "hosted"
"""


@contextlib.contextmanager
def pair(
    tmp_path: Path, *, with_local: bool = False, workers: int = 1, reaper_interval: float = 0.5
) -> Iterator[Pair]:
    """The service and the broker (``reaper_interval``: the broker's, in seconds)."""
    service = SandlotServer(tmp_path / "service").start()
    broker: SandlotServer | None = None
    try:
        key = service.key("svc", "agent")
        key_file = tmp_path / "langsmith-key"
        key_file.write_text(key + "\n")
        key_file.chmod(0o600)
        broker = SandlotServer(
            tmp_path / "broker",
            config=broker_config(
                service.url, key_file, with_local=with_local, reaper_interval=reaper_interval
            ),
            workers=workers,
        ).start()
        yield Pair(service, broker, key)
    except BaseException:
        # What the servers said, for the failure to be understood.
        for srv in (broker, service):
            if srv is not None:
                print("".join(srv.output)[-6000:])
        raise
    finally:
        # Cleaning up runs an event loop of its own: not in the test's.
        with ThreadPoolExecutor(1) as pool:
            if broker is not None:
                broker.stop()
                pool.submit(broker.cleanup).result()
            service.stop()
            pool.submit(service.cleanup).result()

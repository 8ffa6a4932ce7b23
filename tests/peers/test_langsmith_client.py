"""LangSmith's own sandbox client (``langsmith.sandbox``) against sandlot, unchanged:
its control plane is ``/v2/sandboxes/boxes``, its dataplane ``/execute``, ``/execute/ws``,
``/upload`` and ``/download``, with one ``X-Api-Key`` everywhere."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from langsmith import sandbox as sandbox_sdk

from tests.servers import running


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    with running(tmp_path_factory.mktemp("ls") / "d") as srv:
        yield sandbox_sdk.SandboxClient(
            api_endpoint=f"{srv.url}/v2/sandboxes", api_key=srv.key("alice"), timeout=30
        )


def test_create_run_files_list_delete(client: object) -> None:
    sb = client.create_sandbox(name="ls-box")  # type: ignore[attr-defined]
    assert sb.name == "ls-box" and sb.status == "ready" and sb.dataplane_url
    result = sb.run("python3 -c 'print(2 + 2)'; echo oops >&2; exit 3")
    assert (result.stdout, result.stderr, result.exit_code) == ("4\n", "oops\n", 3)
    assert not result.success
    payload = bytes(range(256)) * 1000
    sb.write("data/blob.bin", payload)
    assert hashlib.sha256(sb.read("data/blob.bin")).digest() == hashlib.sha256(payload).digest()
    assert sb.run("wc -c < data/blob.bin").stdout.strip() == str(len(payload))
    names = [s.name for s in client.list_sandboxes()]  # type: ignore[attr-defined]
    assert "ls-box" in names
    again = client.get_sandbox("ls-box")  # type: ignore[attr-defined]
    assert again.id == sb.id
    client.delete_sandbox("ls-box")  # type: ignore[attr-defined]
    assert "ls-box" not in [s.name for s in client.list_sandboxes()]  # type: ignore[attr-defined]


def test_streaming_handle_and_reconnect(client: object) -> None:
    sb = client.create_sandbox()  # type: ignore[attr-defined]
    try:
        chunks: list[str] = []
        result = sb.run("for i in 1 2 3; do echo line$i; sleep 0.1; done", on_stdout=chunks.append)
        assert "".join(chunks) == "line1\nline2\nline3\n" and result.exit_code == 0
        handle = sb.run("echo first; sleep 0.5; echo second", wait=False)
        first = next(iter(handle))
        assert first.data.startswith("first")
        # A second client picks the command up where the first left off.
        resumed = sb.reconnect(handle.command_id, stdout_offset=len(first.data.encode()))
        rest = "".join(c.data for c in resumed)
        assert rest == "second\n"
        assert resumed.result.exit_code == 0
    finally:
        client.delete_sandbox(sb.name)  # type: ignore[attr-defined]

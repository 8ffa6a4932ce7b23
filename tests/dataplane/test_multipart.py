"""Multipart uploads: the file is written as it is parsed, never kept outside the sandbox,
and a body that is not one whole upload of one file leaves nothing behind."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandlot.dataplane.http.multipart import MAX_FIELD_BYTES, MAX_PARTS
from tests.dataplane.conftest import Server, start_server

MiB = 1 << 20
BOUNDARY = "b0undary-x"
CTYPE = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def part(name: str, data: bytes, filename: str | None = "f.bin") -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
    return head + data + b"\r\n"


END = f"--{BOUNDARY}--\r\n".encode()


def upload(client: httpx.Client, server: Server, path: str, body: bytes) -> httpx.Response:
    return client.post(
        server.url("/files/upload"), params={"path": path}, content=body, headers=CTYPE
    )


def assert_refused(r: httpx.Response, code: str = "INVALID_REQUEST") -> None:
    assert r.status_code == (413 if code == "PAYLOAD_TOO_LARGE" else 400), r.text
    assert r.json()["error"]["code"] == code, r.text


def test_one_file_among_other_fields_is_written_whole(server: Server, client: httpx.Client) -> None:
    blob = bytes(range(256)) * 8192  # 2 MiB: every byte value, the boundary's bytes too
    body = part("note", b"dropped", None) + part("file", blob) + part("more", b"x", None) + END
    r = upload(client, server, "m/one.bin", body)
    assert r.status_code == 201 and r.json()["size"] == len(blob), r.text
    assert (server.workspace / "m/one.bin").read_bytes() == blob
    # ``file`` given as a plain field (``curl -F 'file=<x'``) is the file too.
    r = upload(client, server, "m/plain.txt", part("file", b"plain", None) + END)
    assert r.status_code == 201 and (server.workspace / "m/plain.txt").read_bytes() == b"plain"
    # A body of data split at every size arrives the same.
    r = client.post(
        server.url("/files/upload"),
        params={"path": "m/split.bin"},
        content=(body[i : i + 777] for i in range(0, len(body), 777)),
        headers=CTYPE,
    )
    assert r.status_code == 201 and (server.workspace / "m/split.bin").read_bytes() == blob


def test_a_body_that_is_not_one_whole_upload_leaves_nothing(
    server: Server, client: httpx.Client
) -> None:
    (server.workspace / "kept.txt").write_bytes(b"before")
    blob = b"z" * (3 * MiB)
    cases = {
        # Cut before its closing boundary: the file would be kept cut short.
        "cut": part("file", blob)[:-100],
        "no closing boundary": part("file", blob),
        "two files": part("file", blob) + part("file", b"again") + END,
        "no file": part("other", b"x", None) + END,
        "a field too long": part("file", b"f") + part("big", b"b" * (MAX_FIELD_BYTES + 1)) + END,
        "too many parts": part("file", b"f")
        + b"".join(part(f"p{i}", b"v", None) for i in range(MAX_PARTS))
        + END,
        "not multipart": b"garbage with no boundary at all" * 1000,
    }
    for name, body in cases.items():
        r = upload(client, server, "kept.txt", body)
        assert_refused(r)
        assert (server.workspace / "kept.txt").read_bytes() == b"before", name
        r = upload(client, server, f"new/{name}", body)
        assert_refused(r)
        assert not (server.workspace / "new" / name).exists(), name
    r = client.post(
        server.url("/files/upload"),
        params={"path": "kept.txt"},
        content=part("file", b"x") + END,
        headers={"Content-Type": "multipart/form-data"},  # no boundary
    )
    assert_refused(r)
    assert (server.workspace / "kept.txt").read_bytes() == b"before"
    # No temporary file of an upload given up is left either.
    files = [p for p in server.workspace.rglob("*") if not p.is_dir()]
    assert files == [server.workspace / "kept.txt"], files


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Server]:
    yield from start_server(tmp_path, max_upload_bytes=MiB)


def test_an_upload_over_the_limit_is_refused_before_its_body_ends(small: Server) -> None:
    """A multipart upload over ``max_upload_bytes`` is refused as soon as the file passes
    it, its body not yet ended (Starlette's form parser would first keep all of it in a
    temporary file of the server, outside the sandbox and its limits, then look at its
    size: an upload sent without end would fill the server's disk)."""
    url = httpx.URL(small.url("/files/upload"))
    head = (
        f"POST {url.raw_path.decode()}?path=big HTTP/1.1\r\nHost: {url.host}\r\n"
        f"Authorization: Bearer {small.token()}\r\nContent-Type: {CTYPE['Content-Type']}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    first = part("file", b"")[: -len(b"\r\n")]
    with socket.create_connection((url.host, url.port or 80), timeout=30) as sock:

        def send() -> None:
            try:
                sock.sendall(head + b"%x\r\n%s\r\n" % (len(first), first))
                for _ in range(4):  # 4 MiB of the file, then nothing more, never the end
                    sock.sendall(b"%x\r\n%s\r\n" % (MiB, b"y" * MiB))
            except OSError:
                pass  # the server answered and closed

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        answer = b""
        while b"\r\n\r\n" not in answer:
            got = sock.recv(65536)  # times out (a failure) if no answer comes
            assert got, answer
            answer += got
        sender.join(30)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert not (small.workspace / "big").exists()
    assert os.listdir(small.workspace) == []

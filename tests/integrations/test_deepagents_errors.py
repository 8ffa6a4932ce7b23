"""``SandlotBackend``'s answers at the edges: paths it cannot send, results the server
cut short, pages too large for a model, and the words of its errors.

Every one against a real ``sandlot serve``, as deepagents' middleware would call it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from deepagents.backends.protocol import FileDownloadResponse, FileUploadResponse
from deepagents.backends.sandbox import MAX_OUTPUT_BYTES, TRUNCATION_MSG

from sandlot.integrations.deepagents import SandlotBackend
from tests.servers import SandlotServer

pytestmark = pytest.mark.timeout(120)

#: What a model's JSON arguments may decode to (``"\ud800"`` is valid JSON), and UTF-8,
#: so a URL's query, cannot carry.
SURROGATE = "/workspace/\ud800.txt"


@pytest.fixture(scope="module")
def backend(server: SandlotServer, agent_key: str) -> Iterator[SandlotBackend]:
    opened = SandlotBackend.for_thread("thr_da_edges", url=server.url, api_key=agent_key)
    try:
        yield opened
    finally:
        opened.close()


def both(backend: SandlotBackend, name: str, *args: Any, **kwargs: Any) -> list[Any]:
    """The answers of a method and of its ``a*`` twin."""
    sync = getattr(backend, name)(*args, **kwargs)
    return [sync, asyncio.run(getattr(backend, f"a{name}")(*args, **kwargs))]


def test_a_path_utf8_cannot_carry_is_an_invalid_path_not_an_exception(
    backend: SandlotBackend,
) -> None:
    # read, ls, delete and the transfers raised UnicodeEncodeError (httpx building the
    # URL), which ended the agent's whole run instead of answering the one tool call.
    for result in both(backend, "read", SURROGATE):
        assert result.error == f"File '{SURROGATE}': invalid_path"
    for listed in both(backend, "ls", SURROGATE):
        assert (listed.entries, listed.error) == (None, f"Path '{SURROGATE}': invalid_path")
    for deleted in both(backend, "delete", SURROGATE):
        assert deleted.path is None and deleted.error is not None
        assert deleted.error.endswith("invalid_path")
    for uploaded in both(backend, "upload_files", [(SURROGATE, b"x")]):
        assert uploaded == [FileUploadResponse(path=SURROGATE, error="invalid_path")]
    for downloaded in both(backend, "download_files", [SURROGATE]):
        assert downloaded == [FileDownloadResponse(path=SURROGATE, error="invalid_path")]
    # Those whose path travels in a JSON body had the server's "Invalid JSON" instead.
    for written in both(backend, "write", SURROGATE, "x"):
        assert written.error == f"Failed to write file '{SURROGATE}': invalid_path"
    for edited in both(backend, "edit", SURROGATE, "a", "b"):
        assert edited.error == f"Error editing file '{SURROGATE}': invalid_path"
    for found in both(backend, "glob", "*", SURROGATE):
        assert (found.matches, found.error) == (None, f"Path '{SURROGATE}': invalid_path")
    for matched in both(backend, "grep", "x", SURROGATE):
        assert (matched.matches, matched.error) == (None, f"Path '{SURROGATE}': invalid_path")


@pytest.fixture(scope="module")
def crowded(backend: SandlotBackend) -> str:
    """A directory past the dataplane's caps: 10,050 files, one of 12,000 matching lines."""
    made = backend.execute(
        "mkdir -p /workspace/crowd && cd /workspace/crowd && "
        "python3 -c \"[open(f'f{i}.txt', 'w') for i in range(10050)]\" && "
        "seq 1 12000 | sed 's/^/needle /' > f0.txt"
    )
    assert made.exit_code == 0, made.output
    return "/workspace/crowd"


def test_glob_grep_and_ls_say_when_the_server_cut_them_short(
    backend: SandlotBackend, crowded: str
) -> None:
    # The server's truncated flag was dropped: 10,000 results, taken for all there were.
    for found in both(backend, "glob", "*.txt", crowded):
        assert (len(found.matches), found.truncated) == (10_000, True)
        assert found.truncation_reason == "budget"
    for matched in both(backend, "grep", "needle", crowded):
        assert (len(matched.matches), matched.truncated) == (10_000, True)
    for listed in both(backend, "ls", crowded):
        # LsResult has no flag: the cut is an error beside the entries.
        assert listed.entries is not None and len(listed.entries) == 10_000
        assert listed.error is not None and "truncated" in listed.error
    complete = backend.ls("/workspace")
    assert complete.error is None and complete.entries


def test_grep_max_count_is_the_servers_cap(backend: SandlotBackend, crowded: str) -> None:
    backend.write("/workspace/five.txt", "needle\n" * 5)
    for capped in both(backend, "grep", "needle", crowded, max_count=20_000):
        # Asked of the server, which stops at its own cap and says so.
        assert (len(capped.matches), capped.truncated) == (10_000, True)
    for few in both(backend, "grep", "needle", "/workspace/five.txt", max_count=3):
        assert (len(few.matches), few.truncated) == (3, True)
    for exact in both(backend, "grep", "needle", "/workspace/five.txt", max_count=5):
        assert (len(exact.matches), exact.truncated) == (5, False)
    for none in both(backend, "grep", "needle", "/workspace/five.txt", max_count=0):
        assert (none.error, none.matches, none.truncated) == (None, [], True)
    for uncapped in both(backend, "grep", "needle", "/workspace/five.txt", max_count=-1):
        assert (len(uncapped.matches), uncapped.truncated) == (5, False)


def test_a_page_of_long_lines_is_cut_as_base_sandbox_cuts_it(backend: SandlotBackend) -> None:
    # 2,000 lines of 6,000 characters: one default read returned all 12 MB.
    backend.write("/workspace/wide.txt", ("x" * 5999 + "\n") * 2000)
    for page in both(backend, "read", "/workspace/wide.txt"):
        content = page.file_data["content"]
        assert len(content.encode()) <= MAX_OUTPUT_BYTES
        assert content.endswith(TRUNCATION_MSG)
        whole = (MAX_OUTPUT_BYTES - len(TRUNCATION_MSG.encode())) // 6000
        assert (page.start_line, page.end_line, page.next_offset) == (1, whole, whole)
        assert page.total_lines == 2000
    # The next page starts at the first line not shown whole.
    after = backend.read("/workspace/wide.txt", offset=page.next_offset)
    assert after.start_line == page.next_offset + 1
    # One line longer than a page: shown in part, counted read, so paging moves on.
    backend.write("/workspace/one.txt", "y" * (MAX_OUTPUT_BYTES * 2) + "\nlast\n")
    first = backend.read("/workspace/one.txt")
    assert (first.start_line, first.end_line, first.next_offset) == (1, 1, 1)
    assert len(first.file_data["content"].encode()) <= MAX_OUTPUT_BYTES
    assert backend.read("/workspace/one.txt", offset=1).file_data["content"] == "last"
    # A page that fits is untouched.
    small = backend.read("/workspace/wide.txt", limit=3)
    assert small.file_data["content"] == "\n".join(["x" * 5999] * 3)
    assert (small.end_line, small.next_offset) == (3, 3)


def test_errors_use_the_protocols_words_for_what_the_server_said(
    backend: SandlotBackend,
) -> None:
    backend.write("/workspace/plain.txt", "x\n")
    backend.execute("mkdir -p /workspace/adir")
    # "not a directory" read as "directory": is_directory, for a path under a file.
    for listed in both(backend, "ls", "/workspace/plain.txt"):
        assert listed.error == "Path '/workspace/plain.txt': not_a_directory"
    for listed in both(backend, "ls", "/workspace/absent"):
        assert listed.error == "Path '/workspace/absent': path_not_found"
    for down in both(backend, "download_files", ["/workspace/plain.txt/sub"]):
        assert down[0].error == "invalid_path"
    for up in both(backend, "upload_files", [("/workspace/plain.txt/sub", b"x")]):
        assert up[0].error == "invalid_path"
    for down in both(backend, "download_files", ["/workspace/adir"]):
        assert down[0].error == "is_directory"
    for read in both(backend, "read", "/workspace/adir"):
        assert read.error == "File '/workspace/adir': is_directory"
    # Any other refusal is the server's own words, not a path error it is not.
    backend.execute("mkfifo /workspace/fifo")
    for down in both(backend, "download_files", ["/workspace/fifo"]):
        assert down[0].error == "not a regular file"

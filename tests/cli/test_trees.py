"""The sync client's tar writer: what it writes reads back exactly, with tar(1) and
Python's tarfile, whatever the names, and a file changing mid-sync cannot corrupt it."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

from sandlot.cli.trees import RECORD, LocalTree, TreeFile, scan, tar_stream, walk

NAMES = [
    "a.txt",
    "empty",
    "exactly-512.bin",
    "dir/with space/x.py",
    "ünïcödé/файл.txt",
    "deep/" + "/".join(f"level{i:02d}" for i in range(20)) + "/leaf.txt",  # > 155 + 100
    "d/" + "n" * 99 + ".txt",  # a last component over 100 bytes
    "p/" + "q" * 150 + "/short.txt",  # fits with the ustar prefix
]


def _make(root: Path) -> dict[str, bytes]:
    contents = {}
    for i, rel in enumerate(NAMES):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"empty": b"", "exactly-512.bin": os.urandom(512)}.get(rel, os.urandom(i * 700))
        path.write_bytes(data)
        contents[rel] = data
    (root / "run.sh").write_bytes(b"#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    contents["run.sh"] = b"#!/bin/sh\n"
    (root / "link").symlink_to("a.txt")
    (root / "longlink").symlink_to("x/../" * 25 + "a.txt")  # over 100 bytes: a PAX record
    (root / "out").symlink_to("../" * 40 + "x" * 10)  # points out: not sent
    return contents


def _archive(tree: object, chunk: int = 1 << 20) -> bytes:
    chunks = list(tar_stream(tree, chunk=chunk))  # type: ignore[arg-type]
    return b"".join(chunks)


def test_reads_back_with_tarfile(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    contents = _make(src)
    tree = scan(src)
    assert tree.links_out == [("out", "../" * 40 + "x" * 10)]
    data = _archive(tree, chunk=4096)
    assert len(data) % RECORD == 0
    got: dict[str, bytes] = {}
    links = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:
        for member in tar:
            if member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                got[member.name] = f.read()
                if member.name == "run.sh":
                    assert member.mode & 0o777 == 0o755
            elif member.issym():
                links[member.name] = member.linkname
            else:
                assert member.isdir(), member.name
    assert got == contents
    assert links == {"link": "a.txt", "longlink": "x/../" * 25 + "a.txt"}


def test_gnu_tar_extracts_it(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    contents = _make(src)
    proc = subprocess.run(
        ["tar", "xf", "-", "-C", str(out)], input=_archive(scan(src)), capture_output=True
    )
    assert proc.returncode == 0, proc.stderr
    for rel, data in contents.items():
        assert (out / rel).read_bytes() == data, rel
    assert os.readlink(out / "link") == "a.txt"


def test_a_file_changing_during_the_sync_keeps_the_stream_well_formed(tmp_path: Path) -> None:
    # Scanned at one size, read at another: padded or cut to the scanned size, as tar does.
    (tmp_path / "shrank").write_bytes(b"abc")
    (tmp_path / "grew").write_bytes(b"0123456789" * 100)
    (tmp_path / "after").write_bytes(b"next member")
    tree = scan(tmp_path)
    tree.files = [
        TreeFile("shrank", tmp_path / "shrank", 10, 0o644, 0),
        TreeFile("grew", tmp_path / "grew", 5, 0o644, 0),
        TreeFile("vanished", tmp_path / "vanished", 5, 0o644, 0),
        TreeFile("after", tmp_path / "after", 11, 0o644, 0),
    ]
    got = {}
    with tarfile.open(fileobj=io.BytesIO(_archive(tree)), mode="r|*") as tar:
        for member in tar:
            f = tar.extractfile(member)
            assert f is not None
            got[member.name] = f.read()
    assert got == {"shrank": b"abc" + b"\0" * 7, "grew": b"01234", "after": b"next member"}


def test_progress_counts_every_byte(tmp_path: Path) -> None:
    contents = _make(tmp_path)
    seen: list[int] = []
    list(tar_stream(scan(tmp_path), progress=seen.append))
    assert sum(seen) == sum(len(v) for v in contents.values())


def test_streaming_walk_sends_what_a_scan_does(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    contents = _make(src)
    (src / ".gitignore").write_text("*.log\n")
    (src / "skip.log").write_text("no")
    tree = LocalTree(src)
    digests: dict[str, str] = {}
    data = b"".join(tar_stream(walk(src, tree), chunk=4096, digests=digests))
    scanned = scan(src)
    assert (tree.dirs, tree.symlinks, tree.files) == (
        scanned.dirs,
        scanned.symlinks,
        scanned.files,
    )
    seen_dirs: set[str] = set()
    got: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:
        for member in tar:
            parent = member.name.rsplit("/", 1)[0] if "/" in member.name else ""
            assert parent == "" or parent in seen_dirs  # a directory comes before its entries
            if member.isdir():
                seen_dirs.add(member.name)
            elif member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                got[member.name] = f.read()
    assert got == {**contents, ".gitignore": b"*.log\n"}
    assert set(digests) == set(got)

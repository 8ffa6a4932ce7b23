"""The streaming tar reader of archive uploads, against tarfile and GNU tar's own output."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import random
import subprocess
import tarfile
from pathlib import Path

import pytest

from sandlot.dataplane.services.tarstream import BLOCK, TarError, TarStream


def chunked(data: bytes, rng: random.Random, largest: int = 3000) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        n = rng.randint(1, largest)
        out.append(data[pos : pos + n])
        pos += n
    return out


def read_all(chunks: list[bytes]) -> list[tuple[str, str, int, int, str, bytes]]:
    tar = TarStream(chunks)
    out = []
    for m in tar:
        data = b"".join(bytes(v) for v in tar.data())
        out.append((m.name, m.kind, m.size, m.mode & 0o7777, m.linkname, data))
    return out


def build(fmt: int) -> bytes:
    rng = random.Random(fmt)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        d = tarfile.TarInfo("dir")
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(d)
        names = [
            "dir/a.txt",
            "dir/empty",
            "dir/" + "long-name-" * 12 + ".py",  # beyond 100 bytes
            "deep/" + "/".join(f"level{i:02d}" for i in range(20)) + "/leaf",
            "dir/ünïcode-名前.txt",
            "dir/exactly-512",
        ]
        for i, name in enumerate(names):
            size = 512 if name.endswith("512") else (0 if "empty" in name else rng.randint(1, 5000))
            info = tarfile.TarInfo(name)
            info.size, info.mode = size, 0o600 + i
            tar.addfile(info, io.BytesIO(rng.randbytes(size)))
        link = tarfile.TarInfo("dir/link")
        link.type, link.linkname = tarfile.SYMTYPE, "a.txt"
        tar.addfile(link)
        long_link = tarfile.TarInfo("dir/longlink")
        long_link.type, long_link.linkname = tarfile.SYMTYPE, "x/" * 70 + "target"
        tar.addfile(long_link)
        hard = tarfile.TarInfo("dir/hard")
        hard.type, hard.linkname = tarfile.LNKTYPE, "dir/a.txt"
        tar.addfile(hard)
    return buf.getvalue()


def expected(data: bytes) -> list[tuple[str, str, int, int, str, bytes]]:
    kinds = {tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink"}
    out = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for m in tar:
            kind = "file" if m.isreg() else kinds.get(m.type, "other")
            f = tar.extractfile(m) if m.isreg() else None
            content = f.read() if f is not None else b""
            name = m.name + "/" if m.isdir() and not m.name.endswith("/") else m.name
            out.append((name, kind, m.size, m.mode, m.linkname, content))
    return out


def normalized(members: list[tuple[str, str, int, int, str, bytes]]) -> list[tuple[object, ...]]:
    # tarfile strips a directory's trailing slash; the reader keeps names as written.
    return [(n.rstrip("/"), *rest) for n, *rest in members]


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_same_members_as_tarfile_in_any_chunking(fmt: int) -> None:
    data = build(fmt)
    want = normalized(expected(data))
    rng = random.Random(7)
    for largest in (1, 7, 512, 4096, len(data)):
        assert normalized(read_all(chunked(data, rng, largest))) == want


def test_ustar_prefix_field() -> None:
    name = "p" * 90 + "/" + "q" * 60 + "/" + "file.txt"  # 160 bytes: prefix + name
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    assert buf.getvalue()[345:346] == b"p"  # the prefix field is used
    [(got, kind, size, _, _, content)] = read_all([buf.getvalue()])
    assert (got, kind, size, content) == (name, "file", 3, b"abc")


@pytest.mark.parametrize(
    "compress",
    [gzip.compress, bz2.compress, lzma.compress],
    ids=["gzip", "bzip2", "xz"],
)
def test_compressed_archives(compress: object) -> None:
    data = build(tarfile.PAX_FORMAT)
    packed = compress(data)  # type: ignore[operator]
    rng = random.Random(3)
    assert normalized(read_all(chunked(packed, rng, 300))) == normalized(expected(data))


def test_large_members_come_out_in_bounded_pieces() -> None:
    payload = os.urandom(3 << 20)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("big")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    tar_gz = gzip.compress(buf.getvalue(), compresslevel=1)
    stream = TarStream([tar_gz[i : i + 65536] for i in range(0, len(tar_gz), 65536)])
    got, names = bytearray(), []
    for m in stream:
        names.append(m.name)
        for view in stream.data():
            assert len(view) <= 1 << 20  # never the whole member in memory
            got += view
    assert names == ["big"] and bytes(got) == payload


def test_gnu_tar_output(tmp_path: Path) -> None:
    src = tmp_path / "src"
    deep = src / ("d" * 120) / "sub"
    deep.mkdir(parents=True)
    (deep / ("f" * 150)).write_bytes(b"long")
    (src / "plain").write_bytes(b"x" * 1000)
    os.symlink("plain", src / "ln")
    out = subprocess.run(["tar", "cf", "-", "-C", str(src), "."], capture_output=True, check=True)
    assert normalized(read_all([out.stdout])) == normalized(expected(out.stdout))


def test_base256_size() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("n")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    block = bytearray(buf.getvalue()[:BLOCK])
    block[124:136] = b"\x80" + (5).to_bytes(11, "big")
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    data = bytes(block) + buf.getvalue()[BLOCK:]
    [(name, kind, size, _, _, content)] = read_all([data])
    assert (name, kind, size, content) == ("n", "file", 5, b"hello")


def test_an_empty_archive_has_no_members() -> None:
    assert read_all([bytes(2 * BLOCK)]) == []
    # No end-of-archive blocks at all: the stream ends at a member boundary.
    data = build(tarfile.PAX_FORMAT)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        last = tar.getmembers()[-1]
    assert normalized(read_all([data[: last.offset]])) == normalized(expected(data))[:-1]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "empty body"),
        (b"not a tar at all" * 100, "not a tar archive"),
        (b"short", "not a tar archive"),
    ],
)
def test_not_an_archive(body: bytes, message: str) -> None:
    with pytest.raises(TarError, match=message):
        read_all([body] if body else [])


def test_damage_is_an_error_not_a_short_archive() -> None:
    data = build(tarfile.GNU_FORMAT)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    second = members[1].offset
    corrupt = bytearray(data)
    corrupt[second + 10] ^= 0xFF  # a later header's name: its checksum no longer matches
    with pytest.raises(TarError, match="corrupt tar header"):
        read_all([bytes(corrupt)])
    # Cut inside a member's data, and inside a header.
    with pytest.raises(TarError, match="truncated"):
        read_all([data[: members[1].offset_data + 10]])
    with pytest.raises(TarError, match="truncated"):
        read_all([data[: second + 100]])
    with pytest.raises(TarError, match="compressed"):
        read_all([gzip.compress(data)[:-200]])


def test_corrupt_pax_header() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("é")  # non-ASCII: a PAX header carries the name
        tar.addfile(info, io.BytesIO(b""))
    data = bytearray(buf.getvalue())
    at = data.index(b" path=")
    data[at - 2 : at] = b"99"  # a record length beyond the header
    with pytest.raises(TarError, match="PAX"):
        read_all([bytes(data)])


def test_byte_sum_is_exact() -> None:
    from sandlot.dataplane.services.tarstream import _byte_sum

    rng = random.Random(1)
    for block in (bytes(BLOCK), b"\xff" * BLOCK, *(rng.randbytes(BLOCK) for _ in range(200))):
        assert _byte_sum(block) == sum(block)


def test_negative_pax_size_is_refused() -> None:
    def padded(data: bytes) -> bytes:
        return data + bytes(-len(data) % BLOCK)

    records = b"11 size=-3\n"
    x = tarfile.TarInfo("././@PaxHeader")
    x.type, x.size = tarfile.XHDTYPE, len(records)
    f = tarfile.TarInfo("f")
    f.size = 3
    data = (
        x.tobuf(tarfile.USTAR_FORMAT)
        + padded(records)
        + f.tobuf(tarfile.USTAR_FORMAT)
        + padded(b"abc")
        + bytes(2 * BLOCK)
    )
    # A negative size must not lower the archive's byte count (the server's cap).
    with pytest.raises(TarError, match="PAX"):
        read_all([data])
    assert read_all([data.replace(b"11 size=-3\n", b"11 size=03\n")])[0][5] == b"abc"

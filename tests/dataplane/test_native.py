"""The C listing scanner writes exactly what the Python path writes, entry for entry."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from sandlot.dataplane.services import native
from sandlot.dataplane.services.fsops import FileOps, _jstr, _Listing, _scan_py
from sandlot.dataplane.services.paths import PathResolver
from sandlot.runtime import artifacts
from sandlot.runtime.base import Mount


@pytest.fixture(scope="module")
def scanner() -> native.Native:
    found = native.library()
    assert found is not None, "the C scanner is not built (see the warning above)"
    return found


def _random_name(rng: random.Random) -> bytes:
    pools = [
        bytes(range(1, 256)),  # anything but NUL
        b'abc.-_ "\\\t\n\x7f',
        "é漢🙂\u2028".encode(),
        b"\xed\xa0\x80\xc0\xaf\xf4\x90\x80\x80\xe2\x82\xff\x80\xbf",  # invalid UTF-8
    ]
    while True:
        pool = rng.choice(pools)
        raw = bytes(rng.choice(pool) for _ in range(rng.randint(1, 40))).replace(b"/", b"_")
        if raw not in (b".", b".."):
            return raw


def _py_entries(fd: int, prefix: str, depth: int) -> tuple[list[str], bool, list[str]]:
    os.lseek(fd, 0, os.SEEK_SET)  # scandir of an fd reads on from its offset
    acc = _Listing([], 10**6)
    truncated, subdirs = _scan_py(acc, fd, prefix, depth)
    return acc.out, truncated, subdirs


def _c_entries(
    scanner: native.Native, fd: int, prefix: str, depth: int, limit: int = 10**6
) -> tuple[list[str], bool, list[str]]:
    text, count, truncated, subdirs = scanner.scan(
        fd, _jstr(prefix)[1:-1].encode("ascii"), limit, depth > 1
    )
    entries = [json.dumps(e, ensure_ascii=True) for e in json.loads(f"[{text}]")]
    assert len(entries) == count
    # Same text, entry by entry: split the C text on the entries' own boundaries.
    out, at = [], 0
    for e in json.loads(f"[{text}]"):
        end = text.index('"modified_at":"', at)
        end = text.index("}", end) + 1
        out.append(text[at:end])
        assert json.loads(out[-1]) == e
        at = end + 1
    assert at >= len(text)
    return out, truncated, subdirs


def test_random_byte_names_types_sizes_and_times(scanner: native.Native, tmp_path: Path) -> None:
    rng = random.Random(20261123)
    root = tmp_path / "d"
    root.mkdir()
    rootb = os.fsencode(root)
    names: set[bytes] = set()
    # The longest names, each byte at its most expensive escape (six characters).
    names.update({b"\xff" * 255, b"\x01" * 255, "🙂".encode() * 63, b'"' * 255})
    while len(names) < 400:
        names.add(_random_name(rng))
    times = [0, 1, 999_999_999, 1_700_000_000_999_999_999, 1_700_000_000_000_500_000, -1,
             -1_500_000_000, 4_102_444_800_123_456_789, 253_402_300_799_999_999_999]  # fmt: skip
    for i, name in enumerate(sorted(names)):
        path = os.path.join(rootb, name)
        kind = i % 5
        if kind == 0:
            os.mkdir(path)
        elif kind == 1:
            os.symlink(b"../elsewhere", path)
        elif kind == 2:
            os.mkfifo(path)
        else:
            with open(path, "wb") as fh:
                fh.write(b"x" * rng.randint(0, 5000))
        if kind != 1:
            with contextlib.suppress(OSError, OverflowError):
                os.utime(path, ns=(0, rng.choice(times)))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for prefix in ("/workspace/d/", '/workspace/q"uo\\te/é🙂/'):
            py, py_trunc, py_sub = _py_entries(fd, prefix, 2)
            c, c_trunc, c_sub = _c_entries(scanner, fd, prefix, 2)
            assert len(py) == len(names) and not py_trunc and not c_trunc
            assert c == py
            assert c_sub == py_sub and len(py_sub) == len(names) // 5
    finally:
        os.close(fd)


def test_limit_and_depth_through_list_json(scanner: native.Native, tmp_path: Path) -> None:
    ws = tmp_path / "workspace"
    for i in range(60):
        d = ws / f"d{i % 4}" / f"e{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_text("y" * i)
    resolver = PathResolver([Mount("/workspace", ws, True)])
    try:
        for limit in (1, 5, 17, 79, 10_000):
            ops = FileOps(resolver, 1 << 20, 1 << 20, limit, 100)
            for depth in (1, 2, 3):
                native._library, saved = None, native._library
                try:
                    expected = ops.list_json("/workspace", depth)
                finally:
                    native._library = saved
                assert native.ready() is scanner
                got = ops.list_json("/workspace", depth)
                assert got == expected, (limit, depth)
                body = json.loads(got)
                assert len(body["entries"]) <= limit
    finally:
        resolver.close()


def test_unreadable_directory_is_an_os_error(scanner: native.Native, tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    os.close(fd)
    with pytest.raises(OSError):
        scanner.scan(fd, b"/x/", 10, False)


def test_an_entry_the_c_code_does_not_format_falls_back_to_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = tmp_path / "workspace"
    ws.mkdir()
    for i in range(50):
        (ws / f"f{i}").write_text("z")

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fdopendir.restype = ctypes.c_void_p
    libc.readdir.argtypes = libc.closedir.argtypes = [ctypes.c_void_p]
    libc.readdir.restype = ctypes.c_void_p

    class HalfWay:
        """Reads part of the directory, as C code stopped by an odd entry would, then gives
        up, leaving the offset it shares with ``fd`` moved on."""

        def scan(self, fd: int, prefix: bytes, limit: int, want: bool) -> Any:
            d = libc.fdopendir(os.dup(fd))
            for _ in range(20):
                assert libc.readdir(d)
            libc.closedir(d)
            raise native.Unsupported()

    resolver = PathResolver([Mount("/workspace", ws, True)])
    try:
        ops = FileOps(resolver, 1 << 20, 1 << 20, 1000, 100)
        monkeypatch.setattr(native, "_library", None)
        expected = ops.list_json("/workspace", 1)
        monkeypatch.setattr(native, "_library", HalfWay())
        assert ops.list_json("/workspace", 1) == expected
        assert len(json.loads(expected)["entries"]) == 50
    finally:
        resolver.close()


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the dataplane's C build as installed, which the loader is pointed at."""
    real = artifacts.package_dir("sandlot.dataplane.services")
    copy = tmp_path / "dataplane"
    copy.mkdir()
    for name in ("native.c", artifacts.MANIFEST, native.LIBRARY):
        shutil.copy2(real / name, copy / name)
    monkeypatch.setattr(artifacts, "package_dir", lambda package: copy)
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_library", None)
    return copy


def _listing_by_python(tmp_path: Path) -> None:
    ws = tmp_path / "workspace"
    ws.mkdir()
    (ws / "f").write_text("x")
    resolver = PathResolver([Mount("/workspace", ws, True)])
    try:
        ops = FileOps(resolver, 1 << 20, 1 << 20, 1000, 100)
        entries = json.loads(ops.list_json("/workspace", 1))["entries"]
        assert [e["path"] for e in entries] == ["/workspace/f"]
    finally:
        resolver.close()


def _refused(caplog: pytest.LogCaptureFixture, tmp_path: Path, why: str) -> None:
    with caplog.at_level(logging.WARNING, logger=native.log.name):
        assert native.library() is None
        assert native.library() is None
    said = [r.getMessage() for r in caplog.records if r.name == native.log.name]
    assert len(said) == 1, said  # once
    assert "pure-Python" in said[0] and why in said[0], said[0]
    assert native.ready() is None
    _listing_by_python(tmp_path)


def test_the_build_installed_is_loaded(installed: Path) -> None:
    assert native.library() is not None


def test_a_modified_library_is_refused(
    installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (installed / native.LIBRARY).open("r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    _refused(caplog, tmp_path, "is not the file built with the package")


def test_a_build_of_another_source_is_refused(
    installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (installed / "native.c").open("a") as f:
        f.write("/* edited since the build */\n")
    _refused(caplog, tmp_path, "was built from another native.c")


def test_a_library_others_can_write_is_refused(
    installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (installed / native.LIBRARY).chmod(0o664)
    _refused(caplog, tmp_path, "writable by its group or by others")


def test_a_manifest_others_can_write_is_refused(
    installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (installed / artifacts.MANIFEST).chmod(0o646)
    _refused(caplog, tmp_path, "writable by its group or by others")


def test_a_library_the_build_did_not_make_says_how_to_build_it(
    installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (installed / artifacts.MANIFEST).write_text('{"format": 1, "artifacts": {}}')
    _refused(caplog, tmp_path, "apt-get install -y gcc libc6-dev libseccomp-dev")


def test_turned_off_it_is_not_loaded_until_turned_on(
    installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "_wanted", False)
    assert native.library() is None
    native.configure(True)
    assert native.library() is not None

"""The init and the launcher are the programs built with the package, or are not used.

Each is checked against the build manifest beside it (``sandlot.runtime.artifacts``): a
file changed after the build, a build of another source, a file others can write or
someone else's is refused, with a message that says how to rebuild.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot.runtime import artifacts, initbin, tools
from sandlot.runtime.local import LocalRuntimeManager, RuntimeSettings
from sandlot.runtime.preflight import RuntimeUnavailable

HINT = "sudo apt-get install -y gcc libc6-dev libseccomp-dev"


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A copy of the runtime's C build as installed, which the runtime is pointed at."""
    real = artifacts.package_dir("sandlot.runtime")
    copy = tmp_path / "runtime"
    copy.mkdir()
    for name in ("init.c", "limit.c", artifacts.MANIFEST, initbin.INIT, tools.LIMIT):
        shutil.copy2(real / name, copy / name)
    monkeypatch.setattr(artifacts, "package_dir", lambda package: copy)
    tools.host_limit.cache_clear()
    yield copy
    tools.host_limit.cache_clear()


def _flip_a_byte(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 1]))


def test_the_builds_installed_are_used(installed: Path) -> None:
    assert initbin.init_binary() == installed / initbin.INIT
    assert tools.host_limit() == str(installed / tools.LIMIT)
    assert len(initbin.export_seccomp(initbin.init_binary())) % 8 == 0  # BPF instructions


def test_a_modified_init_is_refused(installed: Path) -> None:
    _flip_a_byte(installed / initbin.INIT)
    with pytest.raises(RuntimeUnavailable, match="the sandbox init is unavailable") as caught:
        initbin.init_binary()
    assert "is not the file built with the package" in str(caught.value)
    assert HINT in str(caught.value)


def test_a_build_of_another_source_is_refused(installed: Path) -> None:
    with (installed / "init.c").open("a") as f:
        f.write("/* edited since the build */\n")
    with pytest.raises(RuntimeUnavailable, match=r"was built from another init\.c"):
        initbin.init_binary()
    # The launcher's source did not change: it is still good.
    assert tools.host_limit() == str(installed / tools.LIMIT)


def test_a_file_others_can_write_is_refused(installed: Path) -> None:
    (installed / initbin.INIT).chmod(0o775)
    with pytest.raises(RuntimeUnavailable, match="writable by its group or by others"):
        initbin.init_binary()
    (installed / initbin.INIT).chmod(0o755)
    initbin.init_binary()
    (installed / artifacts.MANIFEST).chmod(0o666)
    with pytest.raises(RuntimeUnavailable, match="writable by its group or by others"):
        initbin.init_binary()


def test_someone_else_s_file_is_refused(installed: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file away needs root")
    os.chown(installed / initbin.INIT, 65534, 65534)
    with pytest.raises(RuntimeUnavailable, match="belongs to uid 65534"):
        initbin.init_binary()


def test_a_link_is_checked_where_it_points(installed: Path, tmp_path: Path) -> None:
    """An editable install in strict mode links every file of the package from a tree."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for p in installed.iterdir():
        (tree / p.name).symlink_to(p)
    assert artifacts.verify(tree, initbin.INIT) == tree / initbin.INIT
    (installed / initbin.INIT).chmod(0o777)
    with pytest.raises(artifacts.ArtifactUnavailable, match="writable by its group"):
        artifacts.verify(tree, initbin.INIT)


def test_a_build_without_a_compiler_says_how_to_get_one(installed: Path) -> None:
    manifest = installed / artifacts.MANIFEST
    manifest.write_text(json.dumps({"format": 1, "artifacts": {}}))
    with pytest.raises(RuntimeUnavailable, match="sandlot-init was not built") as caught:
        initbin.init_binary()
    assert HINT in str(caught.value) and "pip install --force-reinstall" in str(caught.value)
    manifest.unlink()
    with pytest.raises(RuntimeUnavailable, match=r"build-manifest\.json is missing"):
        initbin.init_binary()
    manifest.write_text("[1]")
    with pytest.raises(RuntimeUnavailable, match="not a build manifest"):
        initbin.init_binary()


def test_without_the_launcher_plain_processes_go_on_and_the_start_says_so_once(
    installed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _flip_a_byte(installed / tools.LIMIT)
    settings = RuntimeSettings(
        run_dir=tmp_path / "run",
        workspaces_dir=tmp_path / "workspaces",
        volumes_dir=tmp_path / "volumes",
        mode="unisolated",
    )
    with caplog.at_level(logging.WARNING, logger=tools.log.name):
        LocalRuntimeManager(settings).preflight()
        assert tools.host_limit() is None
    said = [r.getMessage() for r in caplog.records if r.name == tools.log.name]
    assert len(said) == 1 and "helper launcher unavailable" in said[0], said
    with pytest.raises(artifacts.ArtifactUnavailable, match="is not the file built"):
        tools.prepare_tools_dir(tmp_path / "tools")

"""``setup.py`` builds the C code into the wheel, hardened, with its manifest; without a
compiler the wheel builds all the same, says what is missing, and holds no artifact."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sandlot.runtime import artifacts

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ("sandlot-init", "sandlot-limit")
LIBRARY = "libsandlot-native.so"

pytestmark = pytest.mark.slow


def _wheel(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[Path, str]:
    """The wheel built from a copy of the sources (not the checkout's editable build),
    unpacked with its files' modes, and the build's output."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(
        ROOT / "src",
        project / "src",
        ignore=shutil.ignore_patterns(
            "__pycache__", "*.egg-info", artifacts.MANIFEST, LIBRARY, *PROGRAMS
        ),
    )
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", "dist", "./project"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    [wheel] = (tmp_path / "dist").glob("sandlot-*.whl")
    assert "-py3-none-linux_" in wheel.name  # any Python 3: no artifact is an extension
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = Path(z.extract(info, unpacked))
            path.chmod((info.external_attr >> 16) & 0o755 or 0o644)
    return unpacked / "sandlot", output


def _readelf(*args: str) -> str:
    return subprocess.run(["readelf", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.timeout(120)
def test_the_wheel_holds_hardened_builds_of_its_sources(tmp_path: Path) -> None:
    if shutil.which("readelf") is None:
        pytest.fail("readelf (binutils) is needed to check the builds")
    package, output = _wheel(tmp_path)
    warnings = re.findall(r"^.*\.c:\d+:\d+: warning: .*$", output, re.MULTILINE)
    assert not warnings, "\n".join(warnings)

    # Every module of the sources is in the wheel (a folder without __init__.py would not be).
    sources = Path(__file__).resolve().parents[1] / "src" / "sandlot"
    shipped = {p.relative_to(package) for p in package.rglob("*.py")}
    assert {p.relative_to(sources) for p in sources.rglob("*.py")} <= shipped

    runtime, dataplane = package / "runtime", package / "dataplane" / "services"
    for directory, names in ((runtime, PROGRAMS), (dataplane, (LIBRARY,))):
        manifest = json.loads((directory / artifacts.MANIFEST).read_text())
        assert sorted(manifest["artifacts"]) == sorted(names)
        for name in names:
            assert artifacts.verify(directory, name) == directory / name
            flags = manifest["artifacts"][name]["flags"]
            for flag in ("-Wall", "-Wextra", "-O2", "-fstack-protector-strong"):
                assert flag in flags, (name, flags)
            assert "-D_FORTIFY_SOURCE=2" in flags and "-Wl,-z,relro,-z,now" in flags
            dynamic = _readelf("-d", str(directory / name))
            assert "BIND_NOW" in dynamic, name
            assert "GNU_RELRO" in _readelf("-lW", str(directory / name)), name
            if name in PROGRAMS:
                assert "(NEEDED)" not in dynamic, f"{name} is not static"
                if "-static-pie" in flags:  # where the toolchain links it (Debian does)
                    header = _readelf("-h", str(directory / name))
                    assert "DYN (Position-Independent Executable" in header, name
    symbols = _readelf("--dyn-syms", "-W", str(dataplane / LIBRARY))
    assert "__stack_chk_fail" in symbols  # the stack protector is in
    assert re.search(r"__\w+_chk\b", symbols.replace("__stack_chk_fail", ""))  # fortified calls
    seccomp = subprocess.run([str(runtime / "sandlot-init"), "seccomp"], capture_output=True)
    assert seccomp.returncode == 0 and seccomp.stdout and len(seccomp.stdout) % 8 == 0


@pytest.mark.timeout(120)
def test_without_a_compiler_the_wheel_builds_and_says_what_to_install(tmp_path: Path) -> None:
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc")}
    package, output = _wheel(tmp_path, env)
    assert "sudo apt-get install -y gcc libc6-dev libseccomp-dev" in output
    for name in (*PROGRAMS, LIBRARY):
        assert f"{name} (src/" in output and "was not built: no C compiler" in output
    for directory in (package / "runtime", package / "dataplane" / "services"):
        assert json.loads((directory / artifacts.MANIFEST).read_text())["artifacts"] == {}
        assert not [p for p in directory.iterdir() if p.name in (*PROGRAMS, LIBRARY)]
        with pytest.raises(artifacts.ArtifactUnavailable, match="was not built"):
            artifacts.verify(directory, PROGRAMS[0] if directory.name == "runtime" else LIBRARY)

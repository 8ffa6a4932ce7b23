"""sandlot's C code, compiled when the package is built (a wheel, an install, ``-e``).

The metadata is in ``pyproject.toml``; this file only adds the build step. Three artifacts,
each beside its source in the package:

- ``sandlot/runtime/sandlot-init`` (``init.c``): the sandbox init, a static program (it runs
  in any rootfs image, whatever its libc) linked with libseccomp;
- ``sandlot/runtime/sandlot-limit`` (``limit.c``): the helper launcher, a static program;
- ``sandlot/dataplane/services/libsandlot-native.so`` (``native.c``): the dataplane's file operations,
  a shared library loaded with ctypes. Not a Python extension: no Python ABI in its name,
  and a name no ``import`` can pick up (``native.so`` would shadow ``native.py``).

All three are built with warnings and the hardening flags distributions use (stack
protector, ``_FORTIFY_SOURCE``, position independence, full RELRO). Each package directory
gets a ``build-manifest.json`` recording every artifact's sha256 and the sha256 of the
source it was built from; ``sandlot.runtime.artifacts`` refuses an artifact that does not
match it, or whose source is not the one installed beside it.

Without a C compiler, or without libseccomp's headers for the init, the build says so,
naming the system packages, and goes on: the SDK and the CLI need none of this. The server
then says at start what it does without (``sandlot.runtime.artifacts``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

MANIFEST = "build-manifest.json"
SYSTEM_PACKAGES = "gcc libc6-dev libseccomp-dev"

WARNINGS = ["-Wall", "-Wextra", "-Wformat", "-Wformat-security"]
# Some compilers define _FORTIFY_SOURCE already: redefining it with another value warns.
HARDENING = ["-O2", "-fstack-protector-strong", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=2"]
#: Used where the compiler has them (-fcf-protection is x86 only).
HARDENING_IF_SUPPORTED = ["-fstack-clash-protection", "-fcf-protection"]
LINK = ["-Wl,-z,relro,-z,now", "-Wl,-z,noexecstack"]
#: Programs: static (they run inside any image) and position independent where the
#: toolchain links that (``-static-pie``), else static alone.
PROGRAM_LINKS = [["-fPIE", "-static-pie"], ["-static"]]
LIBRARY_LINKS = [["-fPIC", "-shared"]]
#: The compiler's messages in English, whatever the locale (tests look for "warning:").
_C_LOCALE = {**os.environ, "LC_ALL": "C"}


class Artifact(Extension):
    """A C program or library sandlot runs or loads itself (not a Python extension)."""

    def __init__(
        self,
        package: str,
        filename: str,
        source: str,
        *,
        program: bool,
        without: str,
        libraries: tuple[str, ...] = (),
    ) -> None:
        stem = filename.split(".")[0]
        path = os.path.join("src", *package.split("."), source)
        super().__init__(f"{package}.{stem}", [path], libraries=list(libraries), optional=True)
        self.package = package
        self.filename = filename
        self.program = program
        #: What sandlot does without this artifact (for the build's warning).
        self.without = without


ARTIFACTS = [
    Artifact(
        "sandlot.runtime",
        "sandlot-init",
        "init.c",
        program=True,
        libraries=("seccomp",),
        without="the isolated local runtime is unavailable",
    ),
    Artifact(
        "sandlot.runtime",
        "sandlot-limit",
        "limit.c",
        program=True,
        without="the isolated local runtime is unavailable and the unisolated one bounds "
        "ripgrep without its launcher",
    ),
    Artifact(
        "sandlot.dataplane.services",
        "libsandlot-native.so",
        "native.c",
        program=False,
        without="the dataplane uses its pure-Python file operations",
    ),
]


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class BuildNative(build_ext):
    """``build_ext`` for :class:`Artifact`: the system's C compiler with sandlot's flags,
    then a manifest beside the artifacts. A failure warns and leaves the artifact out."""

    def run(self) -> None:
        self._built: dict[str, dict[str, Any]] = {}
        self._cc: list[str] | None = None
        self._extra: list[str] = []
        self._reason = ""
        super().run()
        for ext in self.extensions:
            if isinstance(ext, Artifact) and ext.name not in self._built:
                self._forget(ext)
        self._write_manifests()

    def get_ext_filename(self, fullname: str) -> str:
        ext = self.ext_map.get(fullname)
        if isinstance(ext, Artifact):
            return os.path.join(*fullname.split(".")[:-1], ext.filename)
        return str(super().get_ext_filename(fullname))

    def get_outputs(self) -> list[str]:
        outputs = list(super().get_outputs())
        if not self.inplace:
            outputs += [os.path.join(self.build_lib, *p.split("."), MANIFEST) for p in _packages()]
        return outputs

    def get_output_mapping(self) -> dict[str, str]:
        mapping = dict(super().get_output_mapping())
        if self.inplace:
            build_py = self.get_finalized_command("build_py")
            for package in _packages():
                regular = os.path.join(self.build_lib, *package.split("."), MANIFEST)
                mapping[regular] = os.path.join(build_py.get_package_dir(package), MANIFEST)
        return mapping

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, Artifact):
            super().build_extension(ext)
            return
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cc = self._compiler()
        if cc is None:
            self._warn(ext, self._reason)
            return
        flags, errors = self._compile(cc, ext, out)
        if flags is None:
            self._warn(ext, f"the compiler failed:\n{errors.strip()[-3000:]}")
            return
        if errors.strip():
            print(f"sandlot: compiling {ext.sources[0]}:\n{errors.rstrip()}", file=sys.stderr)
        os.chmod(out, 0o755 if ext.program else 0o644)
        self._built[ext.name] = {
            "sha256": _sha256(out),
            "source": os.path.basename(ext.sources[0]),
            "source_sha256": _sha256(ext.sources[0]),
            "compiler": self._version(cc),
            "flags": flags,
            "libraries": list(ext.libraries),
        }

    def _compiler(self) -> list[str] | None:
        if self._cc is not None or self._reason:
            return self._cc
        if getattr(self.compiler, "compiler_type", None) != "unix":
            self._reason = "sandlot builds its C code with a Unix C compiler only"
            return None
        cc = list(self.compiler.linker_exe)
        if not cc or shutil.which(cc[0]) is None:
            self._reason = f"no C compiler ({cc[0] if cc else 'cc'} is not installed)"
            return None
        self._cc = cc
        self._extra = [f for f in HARDENING_IF_SUPPORTED if self._supported(cc, f)]
        return cc

    def _supported(self, cc: list[str], flag: str) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            source = os.path.join(tmp, "probe.c")
            with open(source, "w") as f:
                f.write("int main(void) { return 0; }\n")
            probe = [*cc, "-Werror", flag, "-o", os.path.join(tmp, "probe"), source]
            return subprocess.run(probe, capture_output=True, check=False).returncode == 0

    def _compile(self, cc: list[str], ext: Artifact, out: str) -> tuple[list[str] | None, str]:
        """(the flags it was built with, the compiler's messages); no flags if it failed."""
        errors = ""
        for link in PROGRAM_LINKS if ext.program else LIBRARY_LINKS:
            if errors:
                print(f"sandlot: trying {' '.join(link)} instead", file=sys.stderr)
            flags = [*WARNINGS, *HARDENING, *self._extra, *link, *LINK]
            libs = [f"-l{name}" for name in ext.libraries]
            command = [*cc, *flags, "-o", out, ext.sources[0], *libs]
            print(" ".join(command), file=sys.stderr)
            result = subprocess.run(
                command, capture_output=True, text=True, check=False, env=_C_LOCALE
            )
            if result.returncode == 0:
                return flags, result.stderr
            errors = result.stderr or f"exit status {result.returncode}"
        return None, errors

    def _version(self, cc: list[str]) -> str:
        result = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=False)
        return (result.stdout.splitlines() or [""])[0]

    def _warn(self, ext: Artifact, reason: str) -> None:
        rule = "=" * 78
        print(
            f"{rule}\n"
            f"sandlot: {ext.filename} ({ext.sources[0]}) was not built: {reason}\n"
            f"Without it {ext.without}; the SDK and the CLI do not need it.\n"
            f"To build it: sudo apt-get install -y {SYSTEM_PACKAGES}\n"
            "then reinstall sandlot: pip install --force-reinstall --no-deps --no-cache-dir "
            "sandlot\n(in a checkout: pip install -e ., which ./scripts/serve and "
            "./scripts/test run).\n"
            f"{rule}",
            file=sys.stderr,
        )

    def _forget(self, ext: Artifact) -> None:
        """No earlier build of ``ext`` stays behind to be taken for this one's."""
        paths = [os.path.join(self.build_lib, *ext.package.split("."), ext.filename)]
        if self.inplace:
            build_py = self.get_finalized_command("build_py")
            paths.append(os.path.join(build_py.get_package_dir(ext.package), ext.filename))
        for path in paths:
            if os.path.lexists(path):
                os.unlink(path)

    def _write_manifests(self) -> None:
        directories = [self.build_lib]
        build_py = self.get_finalized_command("build_py")
        for package in _packages():
            artifacts = {
                ext.filename: self._built[ext.name]
                for ext in ARTIFACTS
                if ext.package == package and ext.name in self._built
            }
            text = json.dumps({"format": 1, "artifacts": artifacts}, indent=2) + "\n"
            targets = [os.path.join(d, *package.split(".")) for d in directories]
            if self.inplace:
                targets.append(build_py.get_package_dir(package))
            for target in targets:
                os.makedirs(target, exist_ok=True)
                path = Path(target, MANIFEST)
                path.write_text(text)
                path.chmod(0o644)


def _packages() -> list[str]:
    return sorted({ext.package for ext in ARTIFACTS})


class PlatformWheel(bdist_wheel):
    """A wheel for any Python 3 on its platform: the artifacts are programs and a library
    loaded with ctypes, none of them tied to one Python's ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(ext_modules=ARTIFACTS, cmdclass={"build_ext": BuildNative, "bdist_wheel": PlatformWheel})

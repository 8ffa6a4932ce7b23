"""The sync SDK is generated from the async one: committed output is current, and
every public async method has a sync twin with the same signature."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import sandlot.sdk as sdk

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "unasync.py"

PAIRS = [
    (sdk.AsyncSandlot, sdk.Sandlot),
    (sdk.AsyncSandbox, sdk.Sandbox),
    (sdk.AsyncCommand, sdk.Command),
    (sdk.AsyncShell, sdk.Shell),
    (sdk.AsyncEventStream, sdk.EventStream),
]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync_script", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_sync_code_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"run scripts/unasync.py:\n{proc.stderr}"


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=lambda c: c.__name__)
def test_signature_parity(async_cls: type, sync_cls: type) -> None:
    unasync = load_script().unasync
    names = [n for n in vars(async_cls) if not n.startswith("_") or n.startswith("__a")]
    assert names
    for name in names:
        member = getattr(async_cls, name)
        if not callable(member) or isinstance(member, type):
            continue
        twin_name = unasync(name)
        assert hasattr(sync_cls, twin_name), f"{sync_cls.__name__}.{twin_name} is missing"
        want = unasync(str(inspect.signature(member)))
        got = str(inspect.signature(getattr(sync_cls, twin_name)))
        assert got == want, f"{async_cls.__name__}.{name}: {want} != {got}"
        if not name.startswith("__"):
            assert getattr(sync_cls, twin_name).__doc__, f"{sync_cls.__name__}.{twin_name}"
            is_async = inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
            assert not inspect.iscoroutinefunction(getattr(sync_cls, twin_name))
            assert is_async or not inspect.iscoroutinefunction(member)


def test_every_public_symbol_has_a_docstring() -> None:
    for name in sdk.__all__:
        obj = getattr(sdk, name)
        if not obj.__module__.startswith("sandlot.sdk"):
            continue  # re-exported from sandlot.protocol
        assert obj.__doc__, name
        if isinstance(obj, type) and obj.__module__.startswith("sandlot.sdk"):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and callable(member):
                    assert member.__doc__, f"{name}.{attr}"

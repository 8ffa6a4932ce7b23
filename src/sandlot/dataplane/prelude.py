"""What ``python -m sandlot.dataplane`` does before it imports the dataplane: settings of
the interpreter that shorten the standalone dataplane's start (docs/PROVIDERS.md,
"Figures"). Imports nothing of sandlot or of the dataplane's libraries."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys


def prepare() -> None:
    """Before the dataplane's modules are imported, in the process that serves it."""
    # Imports create many objects and few cycles: collecting meanwhile costs a sixth of
    # the start. ``main`` freezes what they made and turns the collector back on.
    gc.disable()
    # pydantic looks for plugins among every installed distribution's entry points (a
    # scan of each one's metadata) before it builds its first model: none serves the
    # dataplane. (Its commands get the template's environment, never this one.)
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "1")
    # PyJWT imports cryptography's X.509 support (certificates as keys: a twentieth of
    # the start) for keys given as PEM certificates; the dataplane's come as JWKs.
    lazy("cryptography.x509")


def lazy(name: str) -> None:
    """Module ``name`` runs on its first attribute use, not when imported (the standard
    library's ``LazyLoader``). It is also set on its package, so that ``from package
    import module`` finds it there (the import system would look at it, and load it)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    package, _, child = name.rpartition(".")
    setattr(sys.modules[package], child, module)


__all__ = ["lazy", "prepare"]

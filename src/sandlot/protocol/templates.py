"""Templates (PROTOCOL.md 2.8) and a sandbox's activity: what the dataplane and the
runtimes need of the control plane's models (re-exported by
:mod:`sandlot.protocol.sessions`)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from enum import StrEnum

from pydantic import Field, field_validator, model_validator

from sandlot.protocol.common import Slug, WireModel


class Resources(WireModel):
    cpu: float = Field(default=1.0, gt=0, le=256)
    memory_mb: int = Field(default=2048, ge=16, le=1 << 22)
    pids: int = Field(default=1024, ge=8, le=1 << 22)
    #: At most 16 TiB, ext4's largest file (a workspace disk is one).
    disk_mb: int | None = Field(default=None, ge=1, le=1 << 24)


class VolumeMount(WireModel):
    volume: Slug
    path: str = Field(min_length=1, max_length=1024, pattern=r"^/[^\x00]*$")
    read_only: bool = False

    @field_validator("path")
    @classmethod
    def _plain_path(cls, path: str) -> str:
        # Checked when the template is made, not when a sandbox of it fails to start:
        # a volume over "/" (the sandbox's root) or a path through ".." was accepted.
        if path == "/" or path.startswith("//") or posixpath.normpath(path) != path:
            raise ValueError(
                "a volume's path is an absolute, normalized path below / (no '.', '..', "
                "'//' or trailing '/')"
            )
        return path


class NetworkMode(StrEnum):
    NONE = "none"
    HOST = "host"


#: The longest delay a template or the broker's policy may name: ten years. (The store
#: keeps some delays in 32-bit columns; a longer one would be refused there.)
MAX_SECONDS = 10 * 365 * 86400


class Template(WireModel):
    name: Slug
    image: str = Field(min_length=1, max_length=4096, description="'host' or a rootfs path")
    resources: Resources = Field(default_factory=Resources)
    network: NetworkMode = NetworkMode.NONE
    env: dict[str, str] = Field(default_factory=dict)
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    shells: dict[str, list[str]] = Field(
        default_factory=lambda: {"default": ["/bin/bash", "-l"]},
    )
    idle_timeout_seconds: int | None = Field(default=None, ge=1, le=MAX_SECONDS)
    hard_ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_SECONDS)
    #: Pins its sandboxes to this configured provider (wins over ``provider_preference``).
    provider: Slug | None = None

    @model_validator(mode="after")
    def _check(self) -> Template:
        for key in self.env:
            if not key or "=" in key or "\x00" in key or "\x00" in self.env[key]:
                raise ValueError(f"invalid environment variable name {key!r}")
        for name, argv in self.shells.items():
            if not argv or any("\x00" in a for a in argv):
                raise ValueError(f"shell profile {name!r} needs a command")
        return self


@dataclass(frozen=True)
class SandboxActivity:
    """What a dataplane sees of a sandbox (its activity report): work in progress is
    never reaped."""

    running_execs: int = 0
    attached_clients: int = 0
    #: Monotonic-independent wall clock (epoch seconds) of the last dataplane operation.
    last_active_at: float | None = None

    @property
    def busy(self) -> bool:
        return self.running_execs > 0 or self.attached_clients > 0

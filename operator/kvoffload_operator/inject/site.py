"""What the injector concludes of one container (`Site`): an engine site and the edit that puts
our flag there (`ShellEdit`, `EnvEdit`, `ArgvEdit`, or appended args), or the `Problem` that
stops it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvoffload_operator.inject import shell

ENV_VAR = "KVOFFLOAD_KV_TRANSFER_CONFIG"  # `inject-via: env`: the script passes it to vllm itself


class Problem(str, Enum):
    """Why a container cannot take our flag, or the pod what we add (mapped onto `SkipReason`
    by `decide`)."""

    NO_ENGINE = "no-engine"
    SHELL_WRAPPER = "shell-wrapper"
    OPAQUE_ENTRYPOINT = "opaque-entrypoint"
    CONFIG_FILE = "config-file"
    BACKEND_AUTO = "backend-auto"
    HAS_KV_TRANSFER_CONFIG = "has-kv-transfer-config"
    HAS_KV_OFFLOADING = "has-kv-offloading"
    OTHER_KV_CACHE = "other-kv-cache"
    HAND_WIRED = "hand-wired"
    MULTI_NODE = "multi-node"
    NAME_CLASH = "name-clash"  # a container, volume or env name we add is taken
    PATH_CLASH = "path-clash"  # a device where we mount
    PORT_CLASH = "port-clash"  # a port the sidecar binds

    @property
    def overridable(self) -> bool:
        """Problems of not seeing what runs, which the user may settle (``inject-via``); the
        others are settings that would clash whatever the user says."""
        return self in (
            Problem.SHELL_WRAPPER,
            Problem.OPAQUE_ENTRYPOINT,
            Problem.CONFIG_FILE,
            Problem.BACKEND_AUTO,
        )


@dataclass(frozen=True)
class ShellEdit:
    """Insert our flag into the script word ``argv(container)[word]`` at character ``offset``,
    quoted for ``parse`` (how many shell parses the text goes through)."""

    word: int
    offset: int
    parse: shell.Parse = shell.Parse.ONCE


@dataclass(frozen=True)
class EnvEdit:
    """Put our config in the container's environment as ``name`` (the user's script passes it)."""

    name: str = ENV_VAR


@dataclass(frozen=True)
class ArgvEdit:
    """Insert ``--kv-transfer-config=<json>`` as the word ``argv(container)[at]``: where the
    engine's arguments hold a bare ``--``, first among them (after the ``--`` the flag would be
    a positional argument; between options and a trailing ``--``, argparse refuses the ``--``)."""

    at: int


Edit = ShellEdit | EnvEdit | ArgvEdit | None  # None: append ``--kv-transfer-config=<json>``


@dataclass(frozen=True)
class Site:
    """The outcome for one container: an engine site (``edit`` None: append to args) or not
    (``problem`` set when the container is, or may be, vLLM's and why it cannot be injected)."""

    engine: bool
    edit: Edit = None
    problem: Problem | None = None
    message: str = ""


NOT_VLLM = Site(False)

"""Who may open what the sidecar creates: its Unix sockets, the pool file, the presence map.

Private to the sidecar's user by default (``--file-mode 0600``): outside Kubernetes (the README's
recipe on a shared host) anyone who can connect to the socket can read and overwrite cached KV of
every engine, and anyone who can open the pool file can read every cached prompt's KV directly.
Inside a pod those files live in the pod's own emptyDirs and vLLM may run as another uid, so the
injector passes ``--file-mode 0666`` (the emptyDirs are the boundary there). Set once, at start,
by the CLI (process-wide: one sidecar per process).
"""

from __future__ import annotations

DEFAULT_MODE = 0o600
_mode = DEFAULT_MODE


def parse_mode(text: str) -> int:
    """An octal mode ``0600``..``0666``; execute bits and anything past rw-rw-rw- are refused."""
    try:
        value = int(text.strip(), 8)
    except ValueError:
        raise ValueError(f"{text!r} is not an octal mode (e.g. 0600, 0660, 0666)") from None
    if value & ~0o666 or not value & 0o600 == 0o600:
        raise ValueError(f"{text!r}: use rw for the owner and at most rw for group/others")
    return value


def set_mode(mode: int) -> None:
    global _mode
    _mode = mode


def file_mode() -> int:
    """Mode of the sockets and the pool file (readers and writers alike)."""
    return _mode


def read_mode() -> int:
    """Mode of files the other side only reads (the presence map): owner rw, read for whom
    ``file_mode`` lets in."""
    return (_mode & 0o444) | 0o600

"""The one directory of a pod's volume the pod may write: `status/`, its connector status files.

The volume's own directory is the agent's (0755, or 2750 and the pod's fsGroup): its sockets
live there. A vLLM container that does not run as root could not write its connector status
files (`connector-status-{role}-{rank}.json`) beside them, so NodePublishVolume makes
`status/` inside it: the pod's fsGroup's with mode 2770 when the pod has one (files made there
keep that group), else 1777 (world-writable, sticky: a container cannot replace another uid's
file). The volume is reachable only through the pod's own mounts (the kubelet's pod directory
is root's, 0750), so "world" is the pod's containers. The connector writes there when the
directory exists; the pod's Stats reads it (regular files only, `connector_status.py`).

A pod running as root can write anywhere in its volume, a link or another file named `status`
included: the directory is opened and changed only through `O_NOFOLLOW` descriptors, so a
planted link is never followed (a restarted agent makes the directory again at every start).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

STATUS_DIR = "status"
MODE_GROUP = 0o2770  # the pod's fsGroup writes; new files keep the group (setgid)
MODE_ANY = 0o1777  # no fsGroup: any uid of the pod's containers writes, none replaces another's

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def make_status_dir(target: str, group: int | None) -> str:
    """Create (or take over) `target/status` with the pod's mode and group; returns its path.
    A non-directory there (a link, a file a root pod planted) is removed first, never
    followed."""
    dfd = os.open(target, _DIR_FLAGS)
    try:
        try:
            os.mkdir(STATUS_DIR, 0o700, dir_fd=dfd)
        except FileExistsError:
            if not stat.S_ISDIR(os.stat(STATUS_DIR, dir_fd=dfd, follow_symlinks=False).st_mode):
                os.unlink(STATUS_DIR, dir_fd=dfd)
                os.mkdir(STATUS_DIR, 0o700, dir_fd=dfd)
        fd = os.open(STATUS_DIR, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dfd)  # fmt: skip
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):  # swapped between mkdir and open
            raise OSError(errno.ENOTDIR, f"{target}/{STATUS_DIR} is not a directory")
        # through the O_PATH descriptor: the very directory checked above, never a link's target
        os.chown(f"/proc/self/fd/{fd}", os.geteuid(), -1 if group is None else group)
        os.chmod(f"/proc/self/fd/{fd}", MODE_ANY if group is None else MODE_GROUP)
    finally:
        os.close(fd)
    return os.path.join(target, STATUS_DIR)


def remove_status_dir(target: str) -> None:
    """Remove `target/status` and whatever the pod's containers left in it (files, links,
    FIFOs, directories), never following a link: `shutil.rmtree` through descriptors, and a
    link named `status` removed itself."""
    try:
        dfd = os.open(target, _DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        try:
            st = os.stat(STATUS_DIR, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(STATUS_DIR, dir_fd=dfd)
        else:
            os.unlink(STATUS_DIR, dir_fd=dfd)  # a link or a file planted in its place
    finally:
        os.close(dfd)

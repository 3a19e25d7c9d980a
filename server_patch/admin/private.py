"""Owner-only files and directories, whatever the umask says.

The admin token, the journal and the disk tier hold secrets and users' prompt tokens: other
local users must not read them. ``os.open(..., 0o600)`` and ``mkdir(0o700)`` are masked by the
umask, which can only remove bits, so each call also sets the mode explicitly afterwards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path | str) -> Path:
    """Create ``path`` and its missing parents as 0700; returns it.

    Directories that already exist keep their mode (a configured parent such as ``$HOME``
    is not ours to change); use :func:`tighten_dir` for a directory that is dedicated to us.
    """
    path = Path(path)
    missing: list[Path] = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:  # another process made it meanwhile
            continue
        os.chmod(directory, DIR_MODE)
    return path


def tighten_dir(path: Path | str) -> Path:
    """Create ``path`` as :func:`private_dir` does, then make it 0700 if we own it."""
    path = private_dir(path)
    try:
        info = path.stat()
        if info.st_uid == os.getuid() and info.st_mode & 0o777 != DIR_MODE:
            os.chmod(path, DIR_MODE)
    except OSError:
        pass
    return path


def open_private(path: Path | str, flags: int) -> int:
    """``os.open`` with mode 0600, also for a file that already existed with a looser mode."""
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:  # not ours (e.g. a root-owned file opened read-only): leave it as it is
        pass
    return fd


def durable_fsync(fd: int) -> None:
    """``fsync``, made durable on macOS too (its plain fsync leaves data in the drive's cache)."""
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:  # file systems without F_FULLFSYNC
            pass
    os.fsync(fd)


def fsync_dir(path: Path | str) -> None:
    """Make a rename or link inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        durable_fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

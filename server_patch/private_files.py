"""Durable, owner-only files: the one fsync helper, and 0600 files in 0700 directories.

The admin token, the journal and the disk tier hold secrets and users' prompt token ids, so
their modes never depend on the umask (``os.open(..., 0o600)`` and ``mkdir(0o700)`` are masked
by it, so each call also sets the mode explicitly). ``fsync`` on macOS only hands the data to
the drive, whose cache may lose it on power loss; ``F_FULLFSYNC`` asks the drive to flush too.
Where the file system refuses it (some network and FUSE mounts), plain ``fsync`` is the best
there is. No MLX import: the launcher and ``apcctl check`` use this before any model loads.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

log = logging.getLogger("server_patch.files")

DIR_MODE = 0o700
FILE_MODE = 0o600


def fsync_fd(fd: int) -> None:
    """Make what was written to ``fd`` durable (``F_FULLFSYNC`` on macOS, else ``fsync``)."""
    if sys.platform == "darwin":
        import fcntl

        full = getattr(fcntl, "F_FULLFSYNC", None)
        if full is not None:
            try:
                fcntl.fcntl(fd, full)
                return
            except OSError:
                pass
    os.fsync(fd)


def fsync_dir(path: Path | str) -> None:
    """Make a rename, link or unlink in ``path`` durable; a directory that cannot be opened
    (or synced, on some file systems) is skipped: the data itself was synced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fsync_fd(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def private_dir(path: Path | str, *, tighten: bool = True) -> Path:
    """Create ``path`` and its missing parents as 0700; returns it.

    Parents that already exist keep their mode (``$HOME`` is not ours to change). With
    ``tighten`` the directory itself is made 0700 even if it existed: use it for directories
    dedicated to us (the disk tier, the journal), not for a configured file's parent.
    """
    path = Path(path)
    missing = [p for p in [path, *path.parents] if not p.exists()]
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:  # another process made it meanwhile
            continue
        _chmod(directory, DIR_MODE)
    if tighten and path not in missing:
        try:
            if path.stat().st_mode & 0o777 != DIR_MODE:
                _chmod(path, DIR_MODE)
        except OSError:
            pass
    return path


def own_private_dir(path: Path | str) -> Path:
    """A directory only this user may use, inside one others may write to: created 0700, or an
    existing real directory (not a symlink) owned by this user, made 0700 (it is ours). One that
    another user made first, or a symlink, raises ``PermissionError``: never write through it."""
    path = Path(path)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a directory of this user's (a symlink, a file or another "
                              "user's): refusing to keep private files there")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def open_private(path: Path | str, flags: int) -> int:
    """``os.open`` with mode 0600, also for a file that already existed with a looser mode."""
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:  # not ours (e.g. a root-owned file opened read-only): leave it as it is
        pass
    return fd


def create_private(path: Path | str) -> int:
    """A new file at ``path`` (it must not exist) for writing, mode 0600; returns the fd."""
    return open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def _chmod(path: Path, mode: int) -> None:
    try:
        os.chmod(path, mode)
    except OSError as exc:  # not ours (a shared mount): say so, keep going
        log.warning("cannot make %s private (%o): %s", path, mode, exc)

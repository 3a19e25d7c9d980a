"""One server per disk directory: an exclusive ``flock`` on ``<root>/.lock`` for the process's life.

Two servers on one directory would each enforce the disk cap alone and delete each other's
in-flight temp files. ``flock`` (Linux and macOS) is released by the kernel when the process
dies, kill -9 included, so a stale lock file never blocks a restart; the file holds the PID of
the holder for the error message only.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from server_patch.disk_paths import prepare_root
from server_patch.private_files import FILE_MODE
from server_patch.disk.integrity import SUFFIX, TMP_MARK

LOCK_NAME = ".lock"


class DiskInUse(RuntimeError):
    """Another process holds the directory's lock."""

    def __init__(self, root: Path, pid: int | None) -> None:
        holder = f"process {pid}" if pid else "another process"
        super().__init__(f"lineage disk directory {root} is in use by {holder} "
                         f"(one server per APC_LINEAGE_DISK_PATH)")
        self.root = root
        self.pid = pid


class DiskLock:
    """Hold with ``acquire()``; ``release()`` (or process exit) lets go."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "DiskLock":
        """Take the lock now or raise ``DiskInUse`` (never waits)."""
        prepare_root(self.root)  # a directory we did not create keeps its mode
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise DiskInUse(self.root, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def remove_leftovers(self) -> list[Path]:
        """Remove the temp files a killed server left in the per-fingerprint directories.

        Only the lock holder may: any other process's temp file could be a write in flight.
        """
        if self._fd is None:
            raise RuntimeError("remove_leftovers needs the lock")
        removed = []
        for path in self.root.glob(f"*/*{TMP_MARK}{SUFFIX}"):
            path.unlink(missing_ok=True)
            removed.append(path)
        return removed

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "DiskLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(root: Path | str) -> int | None:
    """The PID holding ``root``'s lock (0 if unknown), or None when nobody holds it."""
    path = Path(root) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(fd) or 0
    finally:
        os.close(fd)
    return None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None

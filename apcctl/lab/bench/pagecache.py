"""Drop a directory's files from the OS page cache, so the next read of them is cold (issue 29).

A disk restore measured right after the file was written reads it from the page cache: the
issue's 2.6 s stall read a 545 MB file cold. Linux drops one file's clean pages without root
(``posix_fadvise(POSIX_FADV_DONTNEED)``, after an ``fsync`` so no page is dirty); macOS has no
per-file drop, only ``purge`` of the whole cache (root on recent versions), tried without a
password prompt (``sudo -n``). ``mincore`` says how much of the files was resident before and
after, so the report says what happened, never what was hoped for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Dropped:
    """What one drop did: files seen, how (``fadvise``, ``purge`` or ``none``), and the resident
    fraction of their pages before and after (None where ``mincore`` is unavailable)."""

    files: int
    bytes: int
    method: str
    dropped: bool
    resident_before: float | None
    resident_after: float | None
    reason: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def label(self) -> str:
        """``cold`` when the pages left the cache, else ``warm`` and why."""
        if self.dropped:
            return "cold"
        return f"warm ({self.reason})" if self.reason else "warm"


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


def sizes_under(root: Path) -> dict[Path, int]:
    """Each file under ``root`` and its size, skipping one that goes meanwhile."""
    sizes = {}
    for path in files_under(root):
        try:
            sizes[path] = path.stat().st_size
        except FileNotFoundError:  # a temp file renamed meanwhile
            continue
    return sizes


def drop(root: Path) -> Dropped:
    """Drop every file under ``root`` from the page cache (as far as this OS lets a user)."""
    sizes = sizes_under(root)
    files, size = list(sizes), sum(sizes.values())
    before = resident(files)
    if not files:
        return Dropped(0, 0, "none", False, before, before, "no files")
    if hasattr(os, "posix_fadvise"):
        method, reason = "fadvise", ""
        for path in files:
            try:
                _fadvise_dontneed(path)
            except FileNotFoundError:
                continue
    elif sys.platform == "darwin":
        method, reason = "purge", _purge()
    else:
        method, reason = "none", "no way to drop pages on this OS"
    after = resident(files)
    if after is None:  # no mincore: trust the call that did not fail
        ok = not reason
    else:
        ok = not reason and after < 0.05
        if not ok and not reason:
            reason = f"{after:.0%} still resident"
    return Dropped(len(files), size, method, ok, before, after, reason)


def _fadvise_dontneed(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # DONTNEED drops clean pages only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _purge() -> str:
    """macOS: ``purge`` as root without a prompt; '' when it ran, else why not."""
    if shutil.which("purge") is None:
        return "no purge command"
    command = ["purge"] if os.geteuid() == 0 else ["sudo", "-n", "purge"]
    try:
        done = subprocess.run(command, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"purge failed: {exc}"
    return "" if done.returncode == 0 else "purge needs root (sudo -n refused)"


def resident(files: list[Path]) -> float | None:
    """The fraction of the files' pages in the page cache (``mincore``), None if unknown."""
    libc = _libc()
    if libc is None or not files:
        return None
    pages = resident_pages = 0
    for path in files:
        try:
            counted = _resident_pages(libc, path)
        except FileNotFoundError:
            continue
        if counted is None:
            return None
        resident_pages += counted[0]
        pages += counted[1]
    return resident_pages / pages if pages else 0.0


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


def _resident_pages(libc: ctypes.CDLL, path: Path) -> tuple[int, int] | None:
    """(resident pages, pages) of one file, mapped read-only (mapping reads nothing)."""
    size = path.stat().st_size
    page = mmap.PAGESIZE
    count = (size + page - 1) // page
    if count == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * count)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(b & 1 for b in vec), count
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


__all__ = ["Dropped", "drop", "files_under", "resident", "sizes_under"]

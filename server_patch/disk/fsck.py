"""Offline verification of a lineage disk directory (``apcctl check``), without a model.

Every file gets the checks a server would make before trusting it, except those that need the
loaded model: header structure and sizes, format, both digests (the data streamed in chunks),
the metadata against the tensor table, the mlx / mlx-vlm / patch versions against the installed
ones, and its model fingerprint against the per-fingerprint directory it sits in. A file that
fails would be rejected by the server; ``fix`` removes it (only while holding the directory
lock, so never under a running server).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from server_patch.private_files import fsync_dir
from server_patch.disk.integrity import (
    HEADER, IO, SUFFIX, Expected, InvalidFile, check_identity, contents, is_temp, read_header, verify_data,
)
from server_patch.disk.lock import LOCK_NAME, DiskInUse, DiskLock, holder
from server_patch.state.fingerprint import software_identity

TEMP = "temp"  # a temp file no running server is writing: left by a killed one
_FINGERPRINT_DIR = re.compile(r"^[0-9a-f]{16}$")


@dataclass
class Finding:
    path: str
    reason: str
    detail: str
    removed: bool = False


@dataclass
class CheckReport:
    disk_path: str
    checked: int = 0
    damaged: list[Finding] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)  # temp files of the running server
    in_use_by: int | None = None
    fixed: bool = False

    @property
    def clean(self) -> bool:
        return not self.damaged

    def as_dict(self) -> dict:
        by_reason = Counter(f.reason for f in self.damaged)
        return {**asdict(self), "clean": self.clean, "by_reason": dict(sorted(by_reason.items()))}


def lock_root(root: Path) -> Path:
    """The directory whose lock guards ``root``: itself, or the lineage root above a
    per-fingerprint subdirectory."""
    if (root / LOCK_NAME).exists() or not (root.parent / LOCK_NAME).exists():
        return root
    return root.parent


def files(root: Path) -> Iterator[Path]:
    """Lineage files in ``root`` and its per-fingerprint subdirectories."""
    yield from sorted(root.glob(f"*{SUFFIX}"))
    yield from sorted(root.glob(f"*/*{SUFFIX}"))


def verify(path: Path, identity: dict[str, str]) -> Finding | None:
    """None if a server of this software could restore from ``path`` (model aside)."""
    prefix = path.parent.name if _FINGERPRINT_DIR.match(path.parent.name) else None
    try:
        header = read_header(path)
        check_identity(header, contents(header), Expected(identity=identity, fingerprint_prefix=prefix))
        verify_data(path, header)
    except InvalidFile as exc:
        return Finding(str(path), exc.reason, exc.detail)
    except FileNotFoundError:
        raise  # removed meanwhile (by a running server): not damage
    except OSError as exc:
        return Finding(str(path), IO, str(exc))
    except Exception as exc:  # a check we did not foresee: the server would not trust it either
        return Finding(str(path), HEADER, f"{type(exc).__name__}: {exc}")
    return None


def check_dir(root: Path, *, fix: bool = False) -> CheckReport:
    """Verify every file under ``root``; with ``fix``, remove the damaged ones.

    Raises ``DiskInUse`` when ``fix`` is asked while a server holds the directory.
    """
    report = CheckReport(disk_path=str(root))
    guard = lock_root(root)
    lock = DiskLock(guard).acquire() if fix else None  # DiskInUse propagates
    try:
        report.in_use_by = None if fix else holder(guard)
        identity = software_identity()
        for path in files(root):
            if is_temp(path):
                if report.in_use_by is not None:
                    report.in_flight.append(str(path))
                else:
                    report.damaged.append(Finding(str(path), TEMP, "left by an interrupted write"))
                continue
            try:
                finding = verify(path, identity)
            except FileNotFoundError:  # removed by the running server meanwhile
                continue
            report.checked += 1
            if finding is not None:
                report.damaged.append(finding)
        if fix:
            for finding in report.damaged:
                Path(finding.path).unlink(missing_ok=True)
                finding.removed = True
            for directory in {Path(f.path).parent for f in report.damaged}:
                fsync_dir(directory)
            report.fixed = True
    finally:
        if lock is not None:
            lock.release()
    return report


__all__ = ["CheckReport", "DiskInUse", "Finding", "check_dir", "verify"]

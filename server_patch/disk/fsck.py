"""Offline verification of a lineage disk directory (``apcctl check``), without a model.

Every file gets the checks a server would make before trusting it, except those that need the
loaded model: header structure and sizes, format, both digests (the data streamed in chunks),
the metadata against the tensor table, the mlx / mlx-vlm / patch versions against the installed
ones, and its model fingerprint against the per-fingerprint directory it sits in. A file that
fails would be rejected by the server; ``fix`` removes it (only while holding the directory
lock, so never under a running server).

Only our own files are ever candidates: those directly inside the per-fingerprint
subdirectories of a directory ``server_patch.disk.marker`` recognises as a tier. Any other file
is reported as foreign and never opened for removal; a directory that is not a tier (a models
directory given by mistake) is refused by ``fix`` (``NotATier``) and all its files are foreign.
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
from server_patch.disk.lock import DiskInUse, DiskLock, holder
from server_patch.disk.marker import MARKER_NAME, is_tier, ours, tier_of
from server_patch.state.fingerprint import software_identity

TEMP = "temp"  # a temp file no running server is writing: left by a killed one
_FINGERPRINT_DIR = re.compile(r"^[0-9a-f]{16}$")


class NotATier(ValueError):
    """``fix`` was asked for a directory that is not a lineage disk tier."""

    def __init__(self, root: Path) -> None:
        super().__init__(f"{root} is not a lineage disk directory (no {MARKER_NAME} marker and not the layout "
                         "of an earlier version's tier, docs/reliability.md): nothing there is ours to remove")
        self.root = root


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
    tier: bool = True  # the directory is (in) a lineage disk tier
    foreign: list[str] = field(default_factory=list)  # not ours: never checked, never removed

    @property
    def clean(self) -> bool:
        return not self.damaged

    def as_dict(self) -> dict:
        by_reason = Counter(f.reason for f in self.damaged)
        return {**asdict(self), "clean": self.clean, "by_reason": dict(sorted(by_reason.items()))}


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
    """Verify every file of ours under ``root``; with ``fix``, remove the damaged ones.

    Raises ``NotATier`` when ``fix`` is asked for a directory that is not a tier, and
    ``DiskInUse`` when a server holds it.
    """
    report = CheckReport(disk_path=str(root))
    tier = tier_of(root)  # also the directory whose lock guards root
    report.tier = is_tier(tier)
    if fix and not report.tier:
        raise NotATier(root)
    lock = DiskLock(tier).acquire() if fix else None  # DiskInUse propagates
    try:
        report.in_use_by = None if fix else holder(tier)
        identity = software_identity()
        for path in files(root):
            if not report.tier or not ours(path, tier):
                report.foreign.append(str(path))
                continue
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


__all__ = ["CheckReport", "DiskInUse", "Finding", "NotATier", "check_dir", "verify"]

"""The admin endpoint's answers, built as their types (``admin.schema``): entries, anchors, events, sizing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from server_patch.admin.schema import (Budgets, CacheEvent, CheckpointInfo, DiskVolume, EntryInfo, EntryKind,
                                      Residence, Sizing)
from server_patch.lineage import DiskRecord, Entry, Event


def _kind(is_anchor: bool) -> EntryKind:
    return EntryKind.ANCHOR if is_anchor else EntryKind.CONVERSATION


def checkpoint_view(entry: Entry) -> list[CheckpointInfo]:
    return [CheckpointInfo(length=c.length, kind=c.kind, bytes=c.nbytes, created=c.created, last_hit=c.last_hit,
                           hits=c.hits) for c in entry.checkpoints]


def entry_view(entry: Entry, record: DiskRecord | None = None) -> EntryInfo:
    """One lineage entry or anchor held in RAM (and maybe on disk too)."""
    return EntryInfo(
        id=entry.id, kind=_kind(entry.is_anchor), pinned=entry.pinned, length=entry.length, bytes=entry.nbytes,
        kv_bytes=int(entry.kv.nbytes), kv_buffer_bytes=int(entry.kv.held_nbytes),
        checkpoint_bytes=entry.checkpoint_bytes, created=entry.created, last_used=entry.last_used,
        last_hit=entry.last_hit, hits=entry.hits, tier=Residence.RAM_DISK if record is not None else Residence.RAM,
        disk_bytes=record.nbytes if record is not None else 0, label=entry.label, namespace=entry.namespace,
        checkpoints=checkpoint_view(entry))


def record_view(record: DiskRecord) -> EntryInfo:
    """An entry that lives only on disk (its header is all RAM knows of it)."""
    return EntryInfo(
        id=record.id, kind=_kind(record.is_anchor), pinned=record.pinned, length=record.length, bytes=0, kv_bytes=0,
        checkpoint_bytes=0, created=None, last_used=record.last_used, last_hit=None, hits=0, tier=Residence.DISK,
        disk_bytes=record.nbytes, label=record.label, namespace=record.namespace,
        checkpoints=[CheckpointInfo(length=n, kind=k, bytes=None, created=None, last_hit=None, hits=0)
                     for n, k in record.checkpoints])


def cache_event(seq: int, at: float, event: Event) -> CacheEvent:
    return CacheEvent(seq=seq, time=at, type="cache", event=event.kind, entry_id=event.entry_id, length=event.length,
                      bytes=event.nbytes, detail=event.detail)


def event_view(seq: int, at: float, event: Event) -> dict[str, Any]:
    """A cache event as the event stream and the journal write it."""
    return cache_event(seq, at, event).to_json()


# ---------------------------------------------------------------------- sizing
# What the budgets are and whether the machine can hold them, known from the first second:
# before the first request there is no lineage cache, but its configuration and the disk
# volume are already there (``status``, ``entries``, ``apcctl serve`` and the launcher's warning).


def human_size(n: int) -> str:
    """Binary units, for the warnings (the CLI renders its own tables)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def configured_budgets(config: Any, disk_used: int = 0, disk_files: int = 0) -> Budgets:
    """``LineageCache.budgets()``'s shape before the cache exists: the limits, nothing in RAM."""
    return Budgets(ram_used=0, ram_limit=int(config.ram_budget_bytes), conversation_bytes=0, disk_queue_bytes=0,
                   anchor_bytes=0, anchor_bytes_limit=int(config.anchor_max_bytes), anchor_count=0,
                   anchor_count_limit=int(config.anchor_max_entries), disk_used=disk_used,
                   disk_limit=int(config.disk_max_bytes), entries=0, disk_files=disk_files)


def sizing_warnings(config: Any, *, ram_total: int | None, disk_enabled: bool, disk_free: int | None,
                    disk_used: int = 0, disk_cap_default: bool = False) -> list[str]:
    """Budgets this machine cannot honour: a RAM budget above physical memory, a disk cap above
    what the volume can still give the cache (its free space plus the cache's own files).
    ``disk_cap_default``: the cap was not set, so it is the volume-sized default (said so)."""
    out = []
    if ram_total and config.ram_budget_bytes > ram_total:
        out.append(f"RAM budget {human_size(config.ram_budget_bytes)} exceeds physical memory "
                   f"{human_size(ram_total)} (APC_LINEAGE_RAM_BUDGET_BYTES)")
    if disk_enabled and disk_free is not None and config.disk_max_bytes > disk_free + disk_used:
        cap = "the default disk cap (half the volume, at most 1 TiB)" if disk_cap_default else "disk cap"
        out.append(f"{cap} {human_size(config.disk_max_bytes)} exceeds the free space of its volume "
                   f"({human_size(disk_free)} free, {human_size(disk_used)} already cached; "
                   "APC_LINEAGE_DISK_MAX_BYTES): the free-space floor, not the cap, will bound the cache")
    return out


def disk_volume(root: Path, count_files: bool = True) -> DiskVolume:
    """Free and total bytes of the volume ``root`` is (or will be) on, and (``count_files``) the
    bytes of the cache files already there (the running cache's index knows them already)."""
    from server_patch.disk_paths import volume_usage

    total, free = volume_usage(root) or (None, None)
    used = files = 0
    try:
        for item in (os.scandir(root) if count_files and root.is_dir() else ()):
            if item.is_file(follow_symlinks=False) and not item.name.startswith("."):
                used += item.stat(follow_symlinks=False).st_size
                files += 1
    except OSError:
        pass
    return DiskVolume(enabled=True, path=str(root), free_bytes=free, total_bytes=total, files_bytes=used, files=files)


def sizing_view(config: Any, env: Mapping[str, str] = os.environ,
                budgets: Budgets | Mapping[str, int] | None = None, *, startup: bool = False) -> Sizing:
    """Budgets (``budgets`` when the cache runs, else the configured ones), physical memory,
    the disk volume's free space, and what this machine cannot honour. A disk cap nobody set
    (the volume-sized default) that the free space cannot hold is said once, at ``startup``
    (``apcctl serve``, the launcher), not at every status: nobody asked for it."""
    import psutil

    from server_patch.disk_paths import default_disk_root, disk_enabled

    enabled = disk_enabled(env)
    disk = disk_volume(default_disk_root(env), budgets is None) if enabled else DiskVolume(enabled=False)
    if budgets is None:
        budgets = configured_budgets(config, disk.files_bytes or 0, disk.files or 0)
    budgets = Budgets.from_json(budgets, "budgets")
    ram_total = int(psutil.virtual_memory().total)
    cap_default = not (env.get("APC_LINEAGE_DISK_MAX_BYTES") or "").strip()
    warnings = sizing_warnings(config, ram_total=ram_total, disk_enabled=enabled and (startup or not cap_default),
                               disk_free=disk.free_bytes, disk_used=budgets.disk_used, disk_cap_default=cap_default)
    return Sizing(budgets=budgets, ram_total_bytes=ram_total, disk=disk, warnings=warnings)

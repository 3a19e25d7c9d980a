"""``bench stall``'s ``canary-load``: a request arrives while the idle canary loads a disk point.

The canary checks restore points while the server is idle; a disk point's file used to load on
the generation thread with no yield point, so a request arriving then waited for the whole
read (issue 29: TTFT 688 vs 179 ms at 545 MB). Now the file loads on the canary's loader
thread (``server_patch/disk/loader.py``). Here the other session's conversations are written
to the disk tier and dropped from RAM, their files dropped from the page cache, and ``POST
/admin/verify {"entry": id}`` queues a check of one of them; once ``GET /admin/verify`` says
the file is loading (``loading``), the victim sends a short request (restored from RAM). Its
TTFT is measured ``repeat`` times alone and ``repeat`` times so, with the load's own duration
(from the first poll that saw it loading to the first that did not). Stock has no canary: its row
has the TTFT alone only. The check after the load is cut short (``APC_CANARY_MAX_TOKENS`` =
``MAX_TOKENS``: longer points with no restore point that close skip): the event is the load.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from apcctl.lab.bench import pagecache
from apcctl.lab.bench.stall_session import Session, ask_to_disk, disk_root, event_conversation
from apcctl.lab.bench.ttft import BenchError

MAX_TOKENS = 512  # the servers' APC_CANARY_MAX_TOKENS: points past it with no base skip after the load
LOADING_WAIT_S = 60.0  # how long the victim waits for the canary to start loading
IDLE_S = 0.1  # the servers' APC_CANARY_IDLE_S: a round's check starts (and resumes) at once


def settings() -> dict[str, str]:
    """The patched server's extra settings for this scenario."""
    return {"APC_CANARY_MAX_TOKENS": str(MAX_TOKENS), "APC_CANARY_IDLE_S": str(IDLE_S)}


def run(session: Session) -> dict[str, Any]:
    """The scenario's row: the arriving request's TTFT alone and with the canary loading."""
    server = session.server
    ask_to_disk(session, event_conversation(session, "canary"))
    session.ask(session.victim)  # the victim's own entry back in RAM: its request restores from RAM
    alone = [_ttft(session) for _ in range(session.plan.repeat)]
    row: dict[str, Any] = {"ttft_alone_ms": alone, "ttft_alone_median": _median(alone)}
    if not server.patched:
        return {**row, "ttft_with_ms": [], "ttft_with_median": None, "canary": None,
                "note": "stock has no canary"}
    record = _disk_record(session)
    rounds = [_with_canary(session, record) for _ in range(session.plan.repeat)]
    with_ms = [r["ttft_ms"] for r in rounds]
    loads = [r["load_ms"] for r in rounds if r["load_ms"] is not None]
    return {**row, "ttft_with_ms": with_ms, "ttft_with_median": _median(with_ms),
            "ttft_vs_alone": round(_median(with_ms) / _median(alone), 2) if _median(alone) else None,
            "record": {"id": record["id"], "length": record["length"], "disk_bytes": record.get("disk_bytes")},
            "loading_at_arrival": sum(1 for r in rounds if r["loading_at_arrival"]),
            "loading_at_first_token": sum(1 for r in rounds if r["loading_at_first_token"]),
            "load_ms": loads, "load_ms_median": _median(loads),
            "canary": _summed([r["canary"] for r in rounds]), "page_cache": rounds[-1]["page_cache"]}


def _ttft(session: Session) -> float:
    ms, _, _ = session.server.stream(session.victim, 1)
    return round(ms, 1)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def _disk_record(session: Session) -> dict[str, Any]:
    """The longest conversation only on disk: one of the other session's (``context`` tokens),
    never the victim's shorter one, so the canary loads a file of the size the scenario names."""
    listed = session.server.get_json("/admin/entries?tier=disk&kind=conversation")["entries"]
    if not listed:
        raise BenchError(f"{session.server.mode}: canary-load: no conversation on disk only after the flush")
    return max(listed, key=lambda e: int(e["length"]))


def _with_canary(session: Session, record: dict[str, Any]) -> dict[str, Any]:
    """One round: page cache dropped, the check queued, the request sent once the file loads."""
    server = session.server
    dropped = pagecache.drop(disk_root(server))
    answer: dict[str, Any] = {}

    def verify() -> None:
        try:
            answer["value"] = server.get_json("/admin/verify", {"entry": record["id"], "timeout_s": 600}, timeout=620)
        except Exception as exc:  # reported below, after the request
            answer["error"] = exc

    thread = threading.Thread(target=verify, daemon=True)
    thread.start()
    since = _poll_loading(session, thread, until=True)
    ttft = _ttft(session)
    still = since is not None and _loading(session)  # still loading when its one-token reply ended
    ended = _poll_loading(session, thread, until=False) if since is not None else None
    thread.join()
    if "error" in answer:
        raise BenchError(f"{server.mode}: canary-load: POST /admin/verify failed: {answer['error']}")
    load_ms = round((ended - since) * 1000, 1) if since is not None and ended is not None else None
    return {"ttft_ms": ttft, "loading_at_arrival": since is not None, "loading_at_first_token": still,
            "load_ms": load_ms, "canary": _results(answer["value"]),
            "page_cache": dropped.as_dict() | {"label": dropped.label}}


def _loading(session: Session) -> bool:
    return int(session.server.get_json("/admin/verify").get("loading", 0) or 0) > 0


def _poll_loading(session: Session, verify: threading.Thread, *, until: bool) -> float | None:
    """The ``perf_counter`` time ``GET /admin/verify`` first says the canary is loading a file
    (``until=True``) or no longer is (False), polled every 20 ms; None if the check ended first."""
    deadline = time.monotonic() + LOADING_WAIT_S
    while verify.is_alive() and time.monotonic() < deadline:
        if _loading(session) == until:
            return time.perf_counter()
        time.sleep(0.02)
    return None if until else time.perf_counter()


def _results(report: dict[str, Any]) -> dict[str, int]:
    """What the check did: its points by result, the disk points whose file it loaded, and how
    often a request made it stop."""
    disk = [r for r in report.get("results", []) if r.get("tier") == "disk"]
    loaded = [r for r in disk if not str(r.get("reason", "")).startswith(("file no longer", "file rejected"))]
    return {"points": int(report.get("points", 0)), "pass": int(report.get("pass", 0)),
            "fail": int(report.get("fail", 0)), "skip": int(report.get("skip", 0)),
            "disk_points_loaded": len(loaded), "abandoned": int(report.get("abandoned", 0)),
            "complete": int(bool(report.get("complete")))}


def _summed(results: list[dict[str, int]]) -> dict[str, int]:
    return {key: sum(r[key] for r in results) for key in results[0]} if results else {}

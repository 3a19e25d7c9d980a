"""The fleet's gateway process: the Host guard on the public port and smg behind it, in one process.

``python -m apcctl.fleet.launch --listen HOST:PORT --upstream-port N --key-file PATH -- <smg launch args>``

``smg launch`` is itself Python calling smg's Rust router in-process (it releases the GIL), so
this runs the same ``launch_router`` with the guard on a thread beside it: one PID to record and
stop, and the guard dies with smg. The control-plane key is read from its 0600 file and handed
to smg here, never on a command line (``ps`` shows every local user a process's arguments).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from pathlib import Path

CONTROL_PLANE_KEY_ID = "apcctl"  # smg's --control-plane-api-keys entry: id:name:role:key


def control_plane_entry(key: str) -> str:
    if not key or ":" in key or any(c.isspace() for c in key):
        raise SystemExit("apcctl guard: the control-plane key file is empty or malformed")
    return f"{CONTROL_PLANE_KEY_ID}:apcctl fleet:admin:{key}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="apcctl-fleet-gateway")
    parser.add_argument("--listen", required=True, help="HOST:PORT the guard listens on (the gateway's URL)")
    parser.add_argument("--upstream-port", type=int, required=True, help="smg's own port, on 127.0.0.1")
    parser.add_argument("--key-file", type=Path, required=True)
    parser.add_argument("smg_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    smg_args = args.smg_args[1:] if args.smg_args[:1] == ["--"] else args.smg_args

    from apcctl.fleet.guard import HostGuard, listen
    from server_patch.serving.origins import OriginPolicy

    host, _, port = args.listen.rpartition(":")
    host = host.strip("[]")
    key = args.key_file.read_text(encoding="utf-8").strip()
    try:
        policy = OriginPolicy.from_env(os.environ, bound_hosts=[host])
    except ValueError as exc:  # a malformed APC_ALLOWED_HOSTS / APC_ALLOWED_ORIGINS
        raise SystemExit(f"apcctl guard: {exc}") from None
    try:
        sock = listen(host, int(port))
    except OSError as exc:
        raise SystemExit(f"apcctl guard: cannot listen on {args.listen}: {exc}") from None
    guard = HostGuard(sock, args.upstream_port, policy)
    threading.Thread(target=asyncio.run, args=(guard.serve(),), name="apcctl-guard", daemon=True).start()

    from smg.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args([*smg_args, "--host", "127.0.0.1", "--port", str(args.upstream_port),
                                     "--control-plane-api-keys", control_plane_entry(key)]))


if __name__ == "__main__":
    main()

"""Servers several fault files share, one start per test worker instead of one per file.

Package scope: under ``pytest -n 2 --dist loadfile`` each worker starts a server the first time
one of its files asks for it. A test on a shared server must not depend on what another left in
its cache: each sends prompts (or keys, tenants, salts) of its own, and reads the server's log
from where it started (``log_text()[before:]``). A test that stops the server, changes its
settings or injects a process-wide fault starts its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.server_harness import PatchedServer

# The keyed server's keys, given each way: the variable, --api-key and --api-key-file.
KEYS = ("key-one-1c0ffee", "key-two-2beef", "key-three-3cafe")
BODY_CAP = 1 << 20  # the user-tenant server's APC_INFERENCE_MAX_BODY_BYTES


def _running(server: PatchedServer) -> Iterator[PatchedServer]:
    with server:
        yield server


@pytest.fixture(scope="package")
def patched(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatchedServer]:
    """The patched server with the harness's defaults."""
    yield from _running(PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("patched")))


@pytest.fixture(scope="package")
def stock(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatchedServer]:
    """Stock mlx-vlm (``APC_LINEAGE=0``) on the same tiny model: what the rows say of stock."""
    yield from _running(PatchedServer(tiny_model_dir, env={"APC_LINEAGE": "0"},
                                      log_dir=tmp_path_factory.mktemp("stock")))


@pytest.fixture(scope="package")
def user_tenants(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatchedServer]:
    """No keys, the user field taken as the tenant (behind a gateway), and a 1 MiB body cap (the
    tenant middleware parses every body too)."""
    env = {"APC_TENANT_FROM_USER": "1", "APC_INFERENCE_MAX_BODY_BYTES": str(BODY_CAP)}
    yield from _running(PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path_factory.mktemp("user-tenants")))


@pytest.fixture(scope="package")
def keyed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PatchedServer]:
    """A server with the three ``KEYS``, one given each way; ``key_file`` is the file's path."""
    log_dir = tmp_path_factory.mktemp("keyed")
    key_file = log_dir / "keys.txt"
    key_file.write_text(f"# one key a line\n\n{KEYS[2]}\n")
    key_file.chmod(0o644)
    server = PatchedServer(tiny_model_dir, env={"APC_API_KEYS": KEYS[0]}, log_dir=log_dir,
                           args=["--api-key", KEYS[1], "--api-key-file", str(key_file)])
    server.key_file = key_file  # type: ignore[attr-defined]
    yield from _running(server)

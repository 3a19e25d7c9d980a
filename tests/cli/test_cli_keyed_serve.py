"""``apcctl serve --api-key-file`` end to end: a managed server with inference keys.

The keys reach the server through its environment (never its command line), a request needs
one, and ``apcctl restart`` still works: its probe anchor lives in the keyless namespace, which
the admin token reaches.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from apcctl.core.hosts import free_port
from tests.cli.test_cli_server import run, run_json

pytestmark = pytest.mark.server

KEY = "keyed-serve-5ecret"


def _chat(url: str, model: str, key: str | None) -> int:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def keyed(cli_env: Path, tiny_model_dir: Path) -> dict[str, Any]:
    key_file = cli_env / "keys"
    key_file.write_text(KEY + "\n")
    info = run_json("serve", "--name", "keyed", "--model", str(tiny_model_dir), "--api-key-file", str(key_file),
                    "--port", str(free_port()))
    yield info
    run("stop", "--server", "keyed")


def test_the_key_file_travels_in_the_environment_and_guards_inference(keyed: dict[str, Any],
                                                                      tiny_model_dir: Path) -> None:
    spec = json.loads((Path(keyed["state_dir"]) / "server.json").read_text())
    assert spec["env"]["APC_API_KEY_FILE"].endswith("keys") and KEY not in json.dumps(spec)
    assert _chat(keyed["url"], str(tiny_model_dir), None) == 401
    assert _chat(keyed["url"], str(tiny_model_dir), KEY) == 200


def test_a_restart_of_a_keyed_server_passes_its_probe(keyed: dict[str, Any], tiny_model_dir: Path) -> None:
    result = json.loads(run("restart", "--server", "keyed", "--json", "--grace", "30").stdout)
    (server,) = result["servers"]
    assert result["ok"] and server["ok"] and not server["rolled_back"], result
    assert server["probe"]["restored_tokens"] > 0 and "failure" not in server["probe"], server["probe"]
    assert _chat(keyed["url"], str(tiny_model_dir), KEY) == 200
    assert _chat(keyed["url"], str(tiny_model_dir), None) == 401
    assert KEY not in run("logs", "--server", "keyed", "-n", "500").output

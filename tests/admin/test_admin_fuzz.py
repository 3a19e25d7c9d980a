"""Property test over /admin inputs: random ids, bodies and query parameters never give a 500,
and every answer is JSON (the Prometheus text of /admin/metrics aside).

/admin/events streams forever and is left to test_admin_routes.py.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_harness import PatchedServer
from tests.admin.test_admin_routes import call

pytestmark = pytest.mark.server

ROUTES = (
    ("GET", "/admin/status"), ("GET", "/admin/entries"), ("GET", "/admin/entries/{id}"),
    ("DELETE", "/admin/entries/{id}"), ("GET", "/admin/anchors"), ("POST", "/admin/anchors/{id}/pin"),
    ("POST", "/admin/anchors/{id}/unpin"), ("POST", "/admin/anchors"), ("GET", "/admin/requests"),
    ("GET", "/admin/metrics"), ("POST", "/admin/flush"), ("POST", "/admin/drain"), ("POST", "/admin/undrain"),
    ("GET", "/admin/openapi.json"), ("GET", "/admin/verify"), ("POST", "/admin/verify/clear"),
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# Bodies that are close to valid reach the handlers, not only the validation layer.
near_valid = st.fixed_dictionaries({}, optional={
    "system": st.text(min_size=0, max_size=60) | json_values,
    "tools": st.none() | st.lists(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2), max_size=2)
    | json_values,
    "tenant": st.none() | st.text(max_size=10),
    "timeout": st.floats(-5, 5000, allow_nan=False) | json_values,
    "retry_after": st.integers(-5, 5000) | json_values,
})
bodies = st.none() | near_valid | json_values | st.binary(max_size=30)
query_values = st.text(max_size=12) | st.integers(-10, 10**7).map(str)
queries = st.dictionaries(st.sampled_from(["tier", "kind", "since", "limit", "x"]), query_values, max_size=3)
ids = st.text(min_size=1, max_size=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("admin-fuzz")) as running:
        # One request first, so the routes that need the lineage cache reach their handlers.
        running.chat([{"role": "system", "content": "You fuzz. " * 20}, {"role": "user", "content": "hi"}],
                     max_tokens=1)
        yield running


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), entry_id=ids, query=queries, body=bodies)
def test_admin_never_answers_500_and_always_json(server: PatchedServer, route: tuple[str, str], entry_id: str,
                                                  query: dict[str, str], body: Any) -> None:
    method, template = route
    path = template.replace("{id}", urllib.parse.quote(entry_id, safe=""))
    if query:
        path += "?" + urllib.parse.urlencode(query)
    raw = body if isinstance(body, bytes) else None
    try:
        status, headers, answer = call(server, method, path, None if raw is not None else body, raw=raw)
    finally:
        call(server, "POST", "/admin/undrain")
    assert status < 500, (method, path, body, answer)
    if path.startswith("/admin/metrics") and status == 200:
        assert headers["content-type"].startswith("text/plain")
    else:
        assert "json" in headers["content-type"], (method, path, headers)
        assert isinstance(answer, (dict, list)), answer
    if status >= 400:
        assert "detail" in answer, answer
    json.dumps(answer)

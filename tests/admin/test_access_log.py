"""The dashboard's admin polls stay out of the server's access log (issue 36, item 15): a real
server's log after admin reads, an admin write, a refused admin read and an inference-side GET."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from server_patch.admin.access_log import ACCESS_LOGGER, AdminReadsFilter, install
from tests.server_harness import PatchedServer, wait_for


def access_record(method: str, path: str, status: int) -> logging.LogRecord:
    """uvicorn's own access line (``protocols/http/h11_impl.py``)."""
    return logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5555", method, path, "1.1", status), None)


def test_only_successful_admin_reads_are_dropped() -> None:
    keep = AdminReadsFilter().filter
    assert not keep(access_record("GET", "/admin/status", 200))
    assert not keep(access_record("GET", "/admin/requests?since=4&limit=200", 200))
    assert not keep(access_record("HEAD", "/admin", 200))
    assert keep(access_record("GET", "/admin/status", 401))  # a refused read: someone without the token
    assert keep(access_record("POST", "/admin/drain", 200))  # an operator's write
    assert keep(access_record("GET", "/administrator", 200))
    assert keep(access_record("GET", "/v1/models", 200))
    assert keep(logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, "other text", None, None))


def test_the_setting_brings_admin_reads_back() -> None:
    logger = logging.getLogger(ACCESS_LOGGER)
    before = list(logger.filters)
    try:
        assert not install({"APC_LOG_ADMIN_REQUESTS": "1"})
        assert logger.filters == before
        assert install({}) and install({})  # installed once, however often it is asked
        assert sum(isinstance(f, AdminReadsFilter) for f in logger.filters) == 1
        with pytest.raises(ValueError, match="APC_LOG_ADMIN_REQUESTS"):
            install({"APC_LOG_ADMIN_REQUESTS": "sometimes"})
    finally:
        logger.filters[:] = before


@pytest.mark.server
def test_a_real_servers_access_log_has_no_admin_polls(tiny_model_dir: Path, tmp_path: Path) -> None:
    with PatchedServer(tiny_model_dir, log_dir=tmp_path) as server:
        for _ in range(3):
            assert server.admin("GET", "/status")[0] == 200
        assert server.admin("POST", "/undrain")[0] == 200
        assert server.request("GET", "/admin/status")[0] == 401
        assert server.request("GET", "/v1/models")[0] == 200  # logged after all the others
        wait_for(lambda: '"GET /v1/models HTTP/1.1" 200' in server.log_text(), "the last access line", server)
        log = server.log_text()
    assert '"GET /admin/status HTTP/1.1" 200' not in log
    assert '"POST /admin/undrain HTTP/1.1" 200' in log
    assert '"GET /admin/status HTTP/1.1" 401' in log

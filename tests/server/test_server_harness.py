"""The server harness itself (helpers.start_server behind conftest's `srv` fixture) serves requests."""

from __future__ import annotations

from helpers import Server


def test_harness_serves_root(srv: Server) -> None:
    import httpx

    r = httpx.get(srv.url + "/")
    assert r.status_code == 200 and "running" in r.text

"""Who may read: open on loopback, the token from anywhere else (in-process, no sockets needed)."""

from __future__ import annotations

import warnings
from pathlib import Path

from relaunch.api.app import ServerSettings, create_app, load_or_create_token

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


def _client(
    tmp_path: Path, host: str, lock_reads: bool = False, named: str = "127.0.0.1:8080"
) -> tuple[TestClient, str]:
    """A client at address `host` that names the server `named` (its Host header)."""
    token, _ = load_or_create_token(tmp_path)
    app = create_app(ServerSettings(tmp_path, token, lock_reads=lock_reads))
    return TestClient(app, base_url=f"http://{named}", client=(host, 40000)), token


def test_reads_from_another_host_need_the_token(tmp_path: Path) -> None:
    remote, token = _client(tmp_path, "10.1.2.3")
    local, _ = _client(tmp_path, "127.0.0.1")
    local6, _ = _client(tmp_path, "::1", named="[::1]:8080")
    by_name, _ = _client(tmp_path, "127.0.0.1", named="localhost:8080")
    rebound, _ = _client(tmp_path, "127.0.0.1", named="attacker.example")
    for path in ("/v2/p/training-jobs", "/v2/nodes", "/metrics"):
        assert remote.get(path).status_code == 401, path
        assert remote.get(path, headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert local.get(path).status_code == 200, path
        assert local6.get(path).status_code == 200, path
        assert by_name.get(path).status_code == 200, path
        # DNS rebinding: a page of another site, re-pointed at 127.0.0.1, reads nothing
        assert rebound.get(path).status_code == 401, path
        assert rebound.get(path, headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert remote.get("/healthz").status_code == 200
    locked, _ = _client(tmp_path, "127.0.0.1", lock_reads=True)
    assert locked.get("/v2/nodes").status_code == 401


def test_the_token_is_kept_and_not_recreated(tmp_path: Path) -> None:
    first, created = load_or_create_token(tmp_path)
    second, created_again = load_or_create_token(tmp_path)
    assert created and not created_again and first == second and len(first) >= 40
    assert (tmp_path / "server-token").stat().st_mode & 0o777 == 0o600

"""What every route needs: the store and the server's settings (on the app), and the bearer
scheme for the OpenAPI document (the Guard middleware checks the token before any route runs)."""

# No `from __future__ import annotations`: FastAPI reads these annotations at run time.
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from relaunch.store import Store

__all__ = ["ServerSettings", "StoreDep", "auth", "settings_of", "store_of"]


@dataclass(frozen=True)
class ServerSettings:
    state_dir: Path
    token: str
    cluster: Any = None
    """The cluster settings (as a cluster file holds them) that submitted jobs run on."""
    lock_reads: bool = False
    """Reads need the token too (they always do from other hosts than loopback)."""
    engine: Any = None
    """Where submitted jobs run: None for the embedded cluster, or Ray's stored settings."""


_bearer = HTTPBearer(auto_error=False, description="The token printed at the server's first start.")


def auth(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """Documents the bearer scheme; the Guard has checked it already."""
    return None


def store_of(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def settings_of(request: Request) -> ServerSettings:
    settings: ServerSettings = request.app.state.settings
    return settings


StoreDep = Annotated[Store, Depends(store_of)]

"""Nodes: their chips' health and isolation; cordon and release."""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time.
import time
from typing import Any

from fastapi import APIRouter, Depends

from relaunch import service
from relaunch.api.deps import StoreDep, auth
from relaunch.api.errors import ERRORS
from relaunch.report import node_view

__all__ = ["router"]

router = APIRouter(prefix="/v2/nodes", dependencies=[Depends(auth)])


@router.get("", responses=ERRORS, summary="List nodes")
def list_nodes(store: StoreDep) -> dict[str, Any]:
    items = [node_view(n) for n in store.nodes()]
    return {"count": len(items), "items": items}


@router.post(
    "/{node_name}/cordon", responses=ERRORS, summary="Isolate a node: no new pods go there"
)
def cordon(node_name: str, store: StoreDep) -> dict[str, Any]:
    return node_view(service.cordon(store, node_name, time.time()))


@router.post(
    "/{node_name}/release", responses=ERRORS, summary="Release an isolated node back to Ready"
)
def release(node_name: str, store: StoreDep) -> dict[str, Any]:
    return node_view(service.release(store, node_name, time.time()))

"""A list-watch, as Kubernetes' own informers do it: list once (every object as ADDED), then
watch from the list's resource version; when the API server says that version is gone (410
Gone, or an ERROR event of it), list again and go on. The kubernetes client's `Watch` streams
one watch; what to do after one ends or expires is the caller's, and this is that."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

__all__ = ["list_watch"]

WATCH_S = 60
"""How long one watch request runs before it is made again (the server ends it then)."""


def list_watch(
    lister: Callable[..., Any],
    handle: Callable[[str, Any], None],
    stop: threading.Event,
    on_list: Callable[[list[Any]], None] | None = None,
    **selectors: Any,
) -> None:
    """Call `handle(event type, object)` for every object `lister` lists (ADDED) and every
    change after, until `stop`; `on_list` sees each full list (what is gone since the last)."""
    version: str | None = None
    while not stop.is_set():
        try:
            if version is None:
                listed = lister(**selectors)
                version = listed.metadata.resource_version
                if on_list is not None:
                    on_list(listed.items)
                for item in listed.items:
                    handle("ADDED", item)
            stream = watch.Watch()
            for event in stream.stream(
                lister, resource_version=version, timeout_seconds=WATCH_S, **selectors
            ):
                if stop.is_set():
                    stream.stop()
                    break
                if event["type"] == "ERROR":
                    version = None  # expired: list again
                    break
                version = event["object"].metadata.resource_version
                handle(event["type"], event["object"])
        except ApiException as error:
            if error.status == 410:
                version = None
                continue
            stop.wait(1.0)  # the API server restarting, or refusing: again in a moment
        except (HTTPError, OSError):
            stop.wait(1.0)
        time.sleep(0)

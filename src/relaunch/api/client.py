"""A small client of the relaunch server, for the CLI's `--server` mode."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["Client", "ClientError", "summary_from_view"]


class ClientError(Exception):
    """The server refused a request, or could not be reached; the message says what to do."""

    def __init__(self, message: str, problems: list[str] | None = None, status: int = 0) -> None:
        super().__init__(message)
        self.problems = problems or []
        self.status = status


class Client:
    def __init__(self, url: str, token: str | None, project: str = "default") -> None:
        self.url = url.rstrip("/")
        self.project = project
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30.0)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            response = self.http.request(method, path, json=body)
        except httpx.HTTPError as error:
            raise ClientError(
                f"cannot reach the relaunch server at {self.url} ({error}); is `relaunch server` "
                "running, and is --server / RELAUNCH_SERVER right?"
            ) from None
        if response.is_success:
            return response.json()
        try:
            data = response.json()
            message = data.get("error_msg") or response.reason_phrase
            problems = [p["message"] for p in data.get("problems", [])]
        except (ValueError, AttributeError, KeyError, TypeError):
            message, problems = response.text or response.reason_phrase, []
        if response.status_code == 401:
            message += " (set RELAUNCH_TOKEN or pass --token)"
        raise ClientError(
            f"{message} (HTTP {response.status_code})", problems, response.status_code
        )

    def _jobs(self) -> str:
        return f"/v2/{self.project}/training-jobs"

    def submit(self, job: Any, plan: list[dict[str, Any]]) -> dict[str, Any]:
        body = dict(job) if isinstance(job, dict) else job
        if plan and isinstance(body, dict):
            body["fault_plan"] = plan
        result: dict[str, Any] = self._call("POST", self._jobs(), body)
        return result

    def jobs(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._call("GET", self._jobs() + "?limit=1000")["items"]
        return items

    def job(self, ref: str) -> dict[str, Any]:
        if not ref.isdigit():
            named = [j for j in self.jobs() if j["metadata"]["name"] == ref]
            if not named:
                raise ClientError(f"no job {ref!r} in project {self.project!r}", status=404)
            ref = named[0]["metadata"]["id"]
        result: dict[str, Any] = self._call("GET", f"{self._jobs()}/{ref}")
        return result

    def stop(self, ref: str) -> dict[str, Any]:
        job_id = self.job(ref)["metadata"]["id"]
        result: dict[str, Any] = self._call(
            "POST", f"{self._jobs()}/{job_id}/actions", {"action_type": "terminate"}
        )
        return result

    def nodes(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._call("GET", "/v2/nodes")["items"]
        return items

    def node_action(self, node: str, action: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v2/nodes/{node}/{action}")
        return result


def summary_from_view(view: dict[str, Any]) -> dict[str, Any]:
    """The server's job view in the shape `relaunch describe` prints (build_report's)."""
    recovery = view.get("recovery", {})
    return {
        "job": view["metadata"]["name"],
        "id": int(view["metadata"]["id"]),
        "status": view["status"]["phase"],
        "reason": view["status"]["reason"],
        "attempt": view["status"]["attempt"],
        "last_step": view["status"]["last_step"],
        "restarts_used": recovery.get("restarts_used", 0),
        "pod_restarts_used": recovery.get("pod_restarts_used", 0),
        "isolated_nodes": recovery.get("isolated_nodes", []),
        "budgets_left": recovery.get("budgets_left", {}),
        "pods": recovery.get("pods", []),
        "recoveries": recovery.get("records", []),
        "fault_plan": recovery.get("fault_plan", []),
        "goodput": recovery.get("goodput"),
        "restores": recovery.get("restores", []),
    }

"""The API's errors: one JSON shape with the problems `relaunch validate` prints, and the
responses each operation documents.

    {"error_code": "RL.0400", "error_msg": "...", "problems": [{"key", "value", "allowed", "message"}]}
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from relaunch.api.guard import MAX_BODY
from relaunch.errors import MISSING, FaultPlanError, InputError, Problem
from relaunch.service import Ended, NotFound

__all__ = ["ERRORS", "ApiError", "ErrorOut", "install"]


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, problems: tuple[Problem, ...] = (), code: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.problems = problems
        self.code = code or f"RL.{status:04d}"


class ProblemOut(BaseModel):
    key: str
    value: Any = None
    allowed: str
    message: str


class ErrorOut(BaseModel):
    error_code: str = Field(examples=["RL.0400"])
    error_msg: str
    problems: list[ProblemOut] = []


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "Invalid input; `problems` names every key."},
    401: {"model": ErrorOut, "description": "A bearer token is needed."},
    404: {"model": ErrorOut, "description": "No such job or node."},
    413: {"model": ErrorOut, "description": f"The body is larger than {MAX_BODY} bytes."},
    422: {
        "model": ErrorOut,
        "description": "A fault plan that cannot hit its targets in this job and cluster; "
        "`problems` names every entry.",
    },
}
ENDED: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorOut, "description": "The job has ended."}
}


def _problem_json(p: Problem) -> dict[str, Any]:
    value = None if p.value is MISSING else p.value
    try:
        json.dumps(value, allow_nan=False)  # what the response encoder will demand
    except (TypeError, ValueError, RecursionError):
        value = repr(value)[:200]
    return {"key": p.key, "value": value, "allowed": p.allowed, "message": str(p)}


def _error(
    status: int, message: str, problems: tuple[Problem, ...] = (), code: str = ""
) -> JSONResponse:
    body = {
        "error_code": code or f"RL.{status:04d}",
        "error_msg": message,
        "problems": [_problem_json(p) for p in problems],
    }
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _input(_: Request, error: Exception) -> JSONResponse:
    """400 for a job that is not valid; 422 for a fault plan that is not valid or does not fit
    its job (the request was well formed, its faults cannot happen)."""
    assert isinstance(error, InputError)
    status = 422 if isinstance(error, FaultPlanError) else 400
    return _error(status, f"{error.source}: invalid {error.what}", error.problems)


def _invalid(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    problems = []
    for e in error.errors():
        key = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        given = e.get("input")
        if isinstance(given, bytes | str) and key == "body":
            problems.append(
                Problem(
                    key,
                    MISSING,
                    "a JSON body sent with `Content-Type: application/json`",
                    found="not a JSON object",
                )
            )
        else:
            problems.append(Problem(key, given, e.get("msg", "invalid")))
    return _error(400, "invalid request", tuple(problems))


def install(app: FastAPI) -> None:
    """Every error the API can answer, in its one shape."""

    async def api_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, ApiError)
        return _error(error.status, error.message, error.problems, error.code)

    async def input_error(request: Request, error: Exception) -> JSONResponse:
        return _input(request, error)

    async def not_found(_: Request, error: Exception) -> JSONResponse:
        return _error(404, str(error))

    async def ended(_: Request, error: Exception) -> JSONResponse:
        return _error(409, str(error))

    async def invalid(request: Request, error: Exception) -> JSONResponse:
        return _invalid(request, error)

    async def http(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        return _error(error.status_code, str(error.detail))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(InputError, input_error)
    app.add_exception_handler(NotFound, not_found)
    app.add_exception_handler(Ended, ended)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http)

"""OpenAI-style error bodies ({"error": {"message", "type", "code", "param"}}), with llama-server's types."""
from __future__ import annotations

import re

# llama-server's error types, by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI-style body; the message names the problem."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.status, self.message, self.error_type, self.param)


def error_body(status: int, message: str, error_type: str | None = None, param: str | None = None) -> dict:
    error = {"code": status, "message": message, "type": error_type or ERROR_TYPES.get(status, "invalid_request_error")}
    if param is not None:
        error["param"] = param
    return {"error": error}


def bad_field(field: str, message: str) -> APIError:
    """The 400 for a bad request field, its name first in the message."""
    return APIError(400, f"'{field}' {message}", param=field)


NAMES = re.compile(r"'([^'\s]+)'|(?<![\w.\[])(messages\[\d+\][\w.\[\]]*)")


def _rename(path: str, names: dict[str, str]) -> str:
    """path with its longest prefix found in names (cut at a . or [) replaced."""
    for cut in [len(path)] + [i for i in range(len(path) - 1, 0, -1) if path[i] in ".["]:
        new = names.get(path[:cut])
        if new is not None:
            return new + path[cut:]
    return path


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """e in another API's field names (Anthropic's, the Responses API's) for a request parsed as the chat it
    stands for: names maps a chat field, or a prefix of one (messages[3], tools[0].function), to the route's."""
    message = NAMES.sub(lambda m: f"'{_rename(m.group(1), names)}'" if m.group(1) else _rename(m.group(2), names),
                        e.message)
    if e.param and e.message.startswith(e.param + " "):  # the sampling checks' messages start with the bare name
        message = _rename(e.param, names) + message[len(e.param):]
    return APIError(e.status, message, _rename(e.param, names) if e.param else e.param, e.error_type)

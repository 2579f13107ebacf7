"""OpenAI-style error bodies ({"error": {"message", "type", "code", "param"}}), with llama-server's types."""
from __future__ import annotations

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

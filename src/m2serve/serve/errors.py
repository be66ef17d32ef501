"""The server's one error type and its two wire shapes (docs/serving.md §10).

Every API module raises :class:`APIError` (status, message, the field at fault); the app renders it
in the shape of the API that was called: OpenAI's ``{"error": {"message", "type", "param", "code"}}``
or Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

from typing import Any

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# The longest error message (and param) answered and access-logged, in characters. Messages echo request
# values (a model name, an enum value, a dict key in a field path): before, a 5 MB model name came back
# in a 5 MB 404 and a 5 MB access-log line per request.
MAX_ERROR_CHARS = 2048


def clip(text: str | None, limit: int = MAX_ERROR_CHARS) -> str | None:
    """``text`` if at most ``limit`` characters, else its head and tail around a note of how many
    characters were cut (the head names the field, the tail often the accepted values)."""
    if text is None or len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]}...[{len(text) - 2 * keep} characters cut]...{text[-keep:]}"


class APIError(Exception):
    """An error answered with ``status``; ``param`` names the request field at fault (or None).
    ``message`` and ``param`` are clipped to MAX_ERROR_CHARS characters (:func:`clip`)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message, param = clip(message), clip(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def _utf8(s: str | None) -> str | None:
    """A lone surrogate echoed from the request cannot be sent: escape it."""
    return None if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")


def openai_error_body(e: APIError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``; code defaults to the status."""
    code = e.code if e.code is not None else e.status
    return {"error": {"message": _utf8(e.message), "type": e.type, "param": _utf8(e.param), "code": code}}


def anthropic_error_body(e: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type for the status."""
    type_ = _ANTHROPIC_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": type_, "message": _utf8(e.message)}}


_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object", type(None): "null"}


def json_type(value: Any) -> str:
    """The JSON type of a parsed JSON value, for error messages (``an integer``, ``null`` ...)."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def typed_field(obj: dict[str, Any], key: str, kind: type, at: str, required: bool = True) -> Any:
    """``obj[key]`` when it has the JSON type ``kind`` (``str``, ``bool``, ``dict``, ``list``; a boolean
    is not a number); absent or null is allowed (returned as None) unless ``required``.

    Raises APIError 400 naming ``<at>.<key>``, e.g. ``input.3.output: must be a string (got an
    integer)``: the checks of the free-form JSON the request models keep as dicts (content blocks,
    input items), so that a mistyped value is a 400 and never a server error.
    """
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        got = "missing" if key not in obj else f"got {json_type(value)}"
        raise APIError(400, f"{at}.{key}: must be {_JSON_TYPES[kind]} ({got})", param=f"{at}.{key}")
    return value

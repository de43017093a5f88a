"""Safety defaults of the front doors: bearer API key, request limits, and the error every door maps to a status."""
from __future__ import annotations

import hmac
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 8 * 2 ** 20
# Paths anyone may call without the API key (load balancers and orchestrators probe them).
PUBLIC_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})


class APIError(Exception):
    """A request the server refuses or cannot finish: HTTP status, message, OpenAI error type, optional Retry-After."""

    def __init__(self, status: int, message: str, kind: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             413: "RequestTooLargeError", 429: "RateLimitError",
                             503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def headers(self) -> dict[str, str]:
        h = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


@dataclass
class Limits:
    """Per-request bounds, checked before a request reaches the engine."""
    max_prompt_len: int             # prompt tokens
    max_tokens_limit: int           # requested new tokens
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1          # Retry-After sent with 429 (queue full) and 503 (draining / not ready)

    def __post_init__(self):
        for name in ("max_prompt_len", "max_tokens_limit", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def bearer_ok(authorization: str | None, api_key: str | None) -> bool:
    """True when no key is configured or the `Authorization: Bearer <key>` value matches (constant time)."""
    if api_key is None:
        return True
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def check_json_object(body: bytes, limit: int):
    """Parse a request body that must be one JSON object (APIError 413 / 400 otherwise)."""
    import json
    if len(body) > limit:
        raise APIError(413, f"request body is {len(body)} bytes; the limit is {limit} (--max-body-bytes)")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in request body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data

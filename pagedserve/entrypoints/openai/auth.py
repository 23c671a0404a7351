"""API keys: with ``--api-key``, ``/v1/*`` (as vLLM) and the dashboard's data need
``Authorization: Bearer <key>``; a missing or wrong key is a 401 in OpenAI's error body."""

from __future__ import annotations

import hmac

from pagedserve.entrypoints.openai.errors import APIError


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on ``/v1/*`` and on ``extra_paths`` (pure
    ASGI, so streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str, extra_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.extra_paths = frozenset(extra_paths)

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1") or path in self.extra_paths

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not self._protected(scope.get("path", ""))):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization")
        if given is None:
            err = APIError(401, "You didn't provide an API key. Send it in the Authorization "
                                "header as 'Authorization: Bearer YOUR_KEY'.")
        elif not hmac.compare_digest(given, self.expected):
            err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        await err.response()(scope, receive, send)

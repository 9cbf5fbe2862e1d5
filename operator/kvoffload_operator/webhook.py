"""kopf's HTTPS admission server, plus one fix-up pods need.

The API server sends CREATE requests for pods made by controllers without
``metadata.namespace`` in the object (it is in ``request.namespace``); kopf hands handlers only
the object, so the namespace is copied into it before kopf sees the request. The API server sets
the same namespace on admission, so no patch operation results from it.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import kopf


def with_request_namespace(review: dict[str, Any]) -> dict[str, Any]:
    request = review.get("request") or {}
    obj = request.get("object")
    namespace = request.get("namespace")
    if not isinstance(obj, dict) or not namespace:
        return review
    if (obj.get("metadata") or {}).get("namespace"):
        return review
    review = copy.deepcopy(review)
    review["request"]["object"].setdefault("metadata", {})["namespace"] = namespace
    return review


class PodWebhookServer(kopf.WebhookServer):
    """`kopf.WebhookServer` that fills in the pod's namespace from the admission request."""

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        async def namespaced_fn(request: Any, **kwargs: Any) -> Any:
            return await fn(with_request_namespace(request), **kwargs)

        async for client_config in super().__call__(namespaced_fn):
            yield client_config

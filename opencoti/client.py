"""Python client for opencoti's PolyKV control plane and completion routes.

    from opencoti.client import PolykvClient
    with PolykvClient("http://127.0.0.1:8080") as c:
        pool = c.create_pool(prompt=system_prompt, pin=True)
        out = c.complete(system_prompt + question, pool_id=pool["id"], session_id="agent-1")

``AsyncPolykvClient`` has the same methods as coroutines. Built on httpx
(install ``opencoti[client]``). Errors: a 429 raises ``PoolSaturatedError``
carrying ``retry_after`` (seconds, from ``Retry-After``); any other non-2xx
raises ``OpencotiHTTPError`` with the server's status, error type and message.
"""

from __future__ import annotations

import contextlib

from typing import Any, Optional

try:
    import httpx
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("opencoti.client needs httpx: pip install 'opencoti[client]'") from e


class OpencotiHTTPError(RuntimeError):
    """A non-2xx answer: ``status``, ``type`` (llama.cpp error type) and ``message``."""

    def __init__(self, status: int, type: str, message: str):
        super().__init__(f"HTTP {status} {type}: {message}")
        self.status, self.type, self.message = status, type, message


class PoolSaturatedError(OpencotiHTTPError):
    """HTTP 429: admission refused; retry after ``retry_after`` seconds."""

    def __init__(self, status: int, type: str, message: str, retry_after: Optional[float]):
        super().__init__(status, type, message)
        self.retry_after = retry_after


def _check(r: "httpx.Response") -> Any:
    if r.status_code < 300:
        return r.json()
    try:
        err = r.json().get("error", {})
    except ValueError:
        err = {}
    typ, msg = err.get("type", "error"), err.get("message", r.text)
    if r.status_code == 429:
        ra = r.headers.get("Retry-After")
        raise PoolSaturatedError(429, typ, msg, float(ra) if ra else None)
    raise OpencotiHTTPError(r.status_code, typ, msg)


def _prefix_body(prompt=None, tokens=None, from_session=None, from_slot=None, **extra) -> dict:
    body = {k: v for k, v in (("prompt", prompt), ("tokens", tokens), ("from_session", from_session),
                              ("from_slot", from_slot)) if v is not None}
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


class _Routes:
    """(method, path, json) for every route; shared by the sync and async clients."""

    @staticmethod
    def create_pool(**kw):
        return "POST", "/polykv/pools", _prefix_body(**kw)

    @staticmethod
    def fork(pool_id: int, branch_pos: Optional[int] = None, pin: Optional[bool] = None, **kw):
        return "POST", f"/polykv/pools/{pool_id}/fork", _prefix_body(branch_pos=branch_pos, pin=pin, **kw)


def _no_stream(fields: dict) -> None:
    if fields.get("stream"):
        raise ValueError("complete() returns one JSON answer: stream=True is not supported here "
                         "(read /completion's SSE stream with an HTTP client instead)")


class PolykvClient:
    """Synchronous client. ``base_url`` like ``http://127.0.0.1:8080``; ``api_key``
    sends ``Authorization: Bearer``; ``timeout`` in seconds."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._http.close()

    def _req(self, method: str, path: str, json: Optional[dict] = None, params: Optional[dict] = None):
        return _check(self._http.request(method, path, json=json, params=params))

    # pools
    def create_pool(self, prompt=None, tokens=None, from_session=None, from_slot=None, pin: bool = False) -> dict:
        return self._req(*_Routes.create_pool(prompt=prompt, tokens=tokens, from_session=from_session,
                                              from_slot=from_slot, pin=pin))

    def list_pools(self) -> list[dict]:
        return self._req("GET", "/polykv/pools")["data"]

    def get_pool(self, pool_id: int) -> dict:
        return self._req("GET", f"/polykv/pools/{pool_id}")

    def fork(self, pool_id: int, prompt=None, tokens=None, branch_pos: Optional[int] = None,
             pin: Optional[bool] = None) -> dict:
        return self._req(*_Routes.fork(pool_id, branch_pos, pin, prompt=prompt, tokens=tokens))

    def fork_by_tokens(self, pool_id: int, suffix_tokens: list[int], pin: bool = False) -> dict:
        """Fork with the parent's tokens + ``suffix_tokens`` (the API wants the full prefix)."""
        parent = self.get_pool_tokens(pool_id)
        return self.fork(pool_id, tokens=parent + list(suffix_tokens), pin=pin)

    def get_pool_tokens(self, pool_id: int) -> list[int]:
        return self._req("GET", f"/polykv/pools/{pool_id}", params={"tokens": "1"})["tokens"]

    def pin(self, pool_id: int) -> dict:
        return self._req("POST", f"/polykv/pools/{pool_id}/pin", {})

    def unpin(self, pool_id: int) -> dict:
        return self._req("POST", f"/polykv/pools/{pool_id}/unpin", {})

    def release(self, pool_id: int) -> dict:
        return self._req("POST", f"/polykv/pools/{pool_id}/release", {})

    def set_sampling(self, pool_id: int, **fields) -> dict:
        return self._req("POST", f"/polykv/pools/{pool_id}/sampling", fields)

    def set_admission(self, pool_id: int, **fields) -> dict:
        return self._req("POST", f"/polykv/pools/{pool_id}/admission", fields)

    def capacity(self, pool_id: int, expected_tokens: int = 256) -> dict:
        return self._req("GET", f"/polykv/pools/{pool_id}/capacity", params={"expected_tokens": expected_tokens})

    def tps(self) -> dict:
        return self._req("GET", "/polykv/tps", params={"once": "1"})

    # text
    def tokenize(self, content: str, add_special: bool = False) -> list[int]:
        return self._req("POST", "/tokenize", {"content": content, "add_special": add_special})["tokens"]

    def complete(self, prompt, **fields) -> dict:
        """``POST /completion`` (non-stream) with any llama.cpp fields (pool_id, session_id, n_predict …).
        Raises ValueError for ``stream=True`` (one JSON answer here; stream with an SSE client)."""
        _no_stream(fields)
        return self._req("POST", "/completion", {"prompt": prompt, **fields})

    def compact_by_refork(self, old_pool_id: int, ancestor_id: int, summary: str,
                          session_ids: tuple[str, ...] = ()) -> dict:
        """Replace a grown pool by a fork of its stable ancestor with ``summary``
        appended: fork ancestor (ancestor prefix + summary tokens), re-home the
        given sessions on it (one short request each, so their slots share the
        new prefix), then unpin and release the old pool. Returns the new pool.
        If re-homing fails, the new pool is unpinned and released (reclaimed once no
        session holds it), the old one is left as it was, and the error is raised."""
        summary_tokens = self.tokenize(summary, add_special=False)
        new = self.fork_by_tokens(ancestor_id, summary_tokens, pin=True)
        try:
            prefix = self.get_pool_tokens(new["id"])
            for sid in session_ids:
                self.complete(prefix, pool_id=new["id"], session_id=sid, n_predict=0)
        except Exception:
            with contextlib.suppress(OpencotiHTTPError):  # roll back; the first error is the one to report
                self.unpin(new["id"])
                self.release(new["id"])
            raise
        self.unpin(old_pool_id)
        self.release(old_pool_id)
        return new


class AsyncPolykvClient:
    """The asyncio twin of ``PolykvClient`` (same methods, awaitable)."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _req(self, method: str, path: str, json: Optional[dict] = None, params: Optional[dict] = None):
        return _check(await self._http.request(method, path, json=json, params=params))

    async def create_pool(self, prompt=None, tokens=None, from_session=None, from_slot=None, pin: bool = False):
        return await self._req(*_Routes.create_pool(prompt=prompt, tokens=tokens, from_session=from_session,
                                                    from_slot=from_slot, pin=pin))

    async def list_pools(self):
        return (await self._req("GET", "/polykv/pools"))["data"]

    async def get_pool(self, pool_id: int):
        return await self._req("GET", f"/polykv/pools/{pool_id}")

    async def get_pool_tokens(self, pool_id: int):
        return (await self._req("GET", f"/polykv/pools/{pool_id}", params={"tokens": "1"}))["tokens"]

    async def fork(self, pool_id: int, prompt=None, tokens=None, branch_pos=None, pin=None):
        return await self._req(*_Routes.fork(pool_id, branch_pos, pin, prompt=prompt, tokens=tokens))

    async def fork_by_tokens(self, pool_id: int, suffix_tokens: list[int], pin: bool = False):
        parent = await self.get_pool_tokens(pool_id)
        return await self.fork(pool_id, tokens=parent + list(suffix_tokens), pin=pin)

    async def pin(self, pool_id: int):
        return await self._req("POST", f"/polykv/pools/{pool_id}/pin", {})

    async def unpin(self, pool_id: int):
        return await self._req("POST", f"/polykv/pools/{pool_id}/unpin", {})

    async def release(self, pool_id: int):
        return await self._req("POST", f"/polykv/pools/{pool_id}/release", {})

    async def set_sampling(self, pool_id: int, **fields):
        return await self._req("POST", f"/polykv/pools/{pool_id}/sampling", fields)

    async def set_admission(self, pool_id: int, **fields):
        return await self._req("POST", f"/polykv/pools/{pool_id}/admission", fields)

    async def capacity(self, pool_id: int, expected_tokens: int = 256):
        return await self._req("GET", f"/polykv/pools/{pool_id}/capacity", params={"expected_tokens": expected_tokens})

    async def tps(self):
        return await self._req("GET", "/polykv/tps", params={"once": "1"})

    async def tokenize(self, content: str, add_special: bool = False):
        return (await self._req("POST", "/tokenize", {"content": content, "add_special": add_special}))["tokens"]

    async def complete(self, prompt, **fields):
        """``PolykvClient.complete``, awaited."""
        _no_stream(fields)
        return await self._req("POST", "/completion", {"prompt": prompt, **fields})

    async def compact_by_refork(self, old_pool_id: int, ancestor_id: int, summary: str,
                                session_ids: tuple[str, ...] = ()):
        summary_tokens = await self.tokenize(summary, add_special=False)
        new = await self.fork_by_tokens(ancestor_id, summary_tokens, pin=True)
        try:
            prefix = await self.get_pool_tokens(new["id"])
            for sid in session_ids:
                await self.complete(prefix, pool_id=new["id"], session_id=sid, n_predict=0)
        except Exception:
            with contextlib.suppress(OpencotiHTTPError):  # roll back, as PolykvClient.compact_by_refork
                await self.unpin(new["id"])
                await self.release(new["id"])
            raise
        await self.unpin(old_pool_id)
        await self.release(old_pool_id)
        return new

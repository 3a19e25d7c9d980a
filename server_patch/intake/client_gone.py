"""Stop a row whose client is gone, streamed or not, at the generation thread's next step.

Stock cancels a streamed request when a token send fails, but a non-streamed one decodes to
``max_tokens`` after its client has left, keeping the GPU busy; a SIGTERM then waits for it until
the supervisor's SIGKILL, so the shutdown flush never runs. This ASGI middleware listens for
``http.disconnect`` once an inference request's body is read (uvicorn sends nothing else
then) and, when it comes before the response is complete, closes every token iterator the
request opened. ``_TokenIterator.close()`` is stock's own cancel: the generation thread removes
the row at its next step and logs ``Generation cancelled``. The request's iterators are found
through a context variable that ``asyncio.to_thread`` carries into the handler's worker thread,
where ``ResponseGenerator.generate`` registers each one (``watched``). ``APC_CANCEL_ON_DISCONNECT=0``
keeps stock's behaviour.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Callable, TypeVar

from server_patch.infra.guard import Receive, Scope, Send, classify, route_path
from server_patch.infra.internal import INTERNAL

ENV = "APC_CANCEL_ON_DISCONNECT"
T = TypeVar("T")


class ClientWatch:
    """One request's cancel callbacks; ``gone()`` runs them, once (from the event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancels: list[Callable[[], object]] | None = []  # None: the client is gone

    def on_gone(self, cancel: Callable[[], object]) -> None:
        """Run ``cancel`` when the client goes, or now if it already has (a worker thread calls this)."""
        with self._lock:
            if self._cancels is not None:
                self._cancels.append(cancel)
                return
        cancel()

    def gone(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels or [], None
        for cancel in cancels:
            cancel()

    def done(self) -> None:
        """The response is complete: nothing may be cancelled any more."""
        with self._lock:
            if self._cancels is not None:
                self._cancels.clear()


CURRENT: contextvars.ContextVar[ClientWatch | None] = contextvars.ContextVar("apc_client_watch", default=None)


def watched(token_iterator: T) -> T:
    """``token_iterator`` (a stock ``_TokenIterator``), closed when this request's client goes."""
    watch = CURRENT.get()
    if watch is not None:
        watch.on_gone(token_iterator.close)  # type: ignore[attr-defined]
    return token_iterator


class ClientGoneWatcher:
    """Notices an inference client that disconnects before its response is complete."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get(INTERNAL) or classify(route_path(scope)) is not None:
            await self.app(scope, receive, send)  # an anchor's in-process prefill has no client to lose
            return
        watch = ClientWatch()
        listener: asyncio.Task[dict] | None = None
        complete = False

        async def listen() -> dict:
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                watch.gone()
            return message

        async def app_receive() -> dict:
            nonlocal listener
            if listener is not None:  # the app asks again (a stream's disconnect check): share the one wait
                return await asyncio.shield(listener)
            message = await receive()
            if message["type"] == "http.disconnect":
                watch.gone()
            elif not message.get("more_body", False):
                listener = asyncio.ensure_future(listen())
            return message

        async def app_send(message: dict) -> None:
            nonlocal complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True  # before the send: uvicorn's receive answers "disconnect" once it is done
                watch.done()
            await send(message)

        token = CURRENT.set(watch)
        try:
            await self.app(scope, app_receive, app_send)
        finally:
            CURRENT.reset(token)
            watch.done()
            if listener is not None and not listener.done():
                listener.cancel()

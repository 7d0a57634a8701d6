"""uvicorn's h11 protocol with a request-head timeout.

uvicorn times out idle keep-alive connections, but not a connection that never completes
a request head: a client that connects and sends nothing, or part of a header, holds its
socket (and a slot of ``limit_concurrency``) forever. This closes such a connection once it
has waited ``header_timeout_s`` for a whole head: from the connection's start, and from the
first byte of each following request on a kept-alive connection.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s = 10.0  # set per server by ``protocol_with_header_timeout``

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_of = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        waiting_before = self._waiting_for_head()
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._head_of:
            self._disarm()  # the head it waited for has arrived
        elif self._head_timer is None and waiting_before and self._waiting_for_head():
            self._arm()  # part of the next request's head, after a kept-alive response

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._head_of = self.cycle
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._on_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_timeout(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and self.cycle is self._head_of and not self.transport.is_closing():
            self.logger.debug("closing a connection that sent no complete request head in %.1f s",
                              self.header_timeout_s)
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    return type("KilnH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": seconds})

"""Run the HTTP server (``kiln serve``): uvicorn with Kiln's timeouts and a graceful
shutdown.

On SIGTERM or SIGINT the server stops admitting (new requests get 503 with Retry-After;
``/ready`` turns 503), lets running requests finish for up to ``shutdown_timeout_s``,
then ends the rest, each stream with a last event whose finish reason is "abort" and
``[DONE]`` (a non-streamed request gets 503), and exits. A second signal exits at once.
"""

from __future__ import annotations

import logging
import threading

import uvicorn

from ..engine import Engine
from .app import create_app
from .config import ServerConfig
from .http_protocol import protocol_with_header_timeout

log = logging.getLogger("kiln.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout_s: float):
        super().__init__(config)
        self._engine = engine
        self._shutdown_timeout_s = shutdown_timeout_s
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is not None:  # a second signal: no more waiting
            log.warning("second signal: exiting now")
            self.should_exit = self.force_exit = True
            return
        log.info("shutting down: new requests are refused; running ones get %.0f s to finish",
                 self._shutdown_timeout_s)
        self._drainer = threading.Thread(target=self._drain, name="kiln-shutdown", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        try:
            if not self._engine.drain(self._shutdown_timeout_s):
                log.warning("shutdown timeout: unfinished requests were ended with finish reason 'abort'")
        finally:
            self.should_exit = True


def uvicorn_config(app, host: str, port: int, config: ServerConfig, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="off",
        http=protocol_with_header_timeout(config.header_timeout_s),
        timeout_keep_alive=max(1, round(config.keep_alive_s)),
        # After the drain every stream has ended; this only bounds connections that do
        # not close after their last response.
        timeout_graceful_shutdown=5)


def serve(engine: Engine, model_name: str, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    app = create_app(engine, model_name, config)
    server = GracefulServer(uvicorn_config(app, host, port, config, log_level), engine, config.shutdown_timeout_s)
    server.run()

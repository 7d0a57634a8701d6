"""The OpenAI-compatible HTTP API over one engine.

    POST /v1/completions        prompt (string or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models             the one served model
    GET  /health                liveness: 200 while the engine core runs and makes progress, else 503
    GET  /ready                 readiness: 200 while requests are admitted (503 when draining or unhealthy)
    GET  /metrics               Prometheus text: TTFT, inter-token latency, queue, KV pages, tokens/s
    (GET routes answer HEAD too.)

No handler waits for the engine's step: a request is validated, tokenized and rendered in
a worker thread (never on the event loop), handed to the engine core, and its tokens are
read from its own stream. A client that disconnects (mid-stream or while waiting for a full
response) cancels its request, which frees its KV pages. Malformed bodies get 400 naming
the field, oversized ones 413, a full queue 429, a draining server 503; no bad request
affects the others.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from dataclasses import asdict

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from ..engine import Engine
from ..errors import KilnError
from ..metrics import CONTENT_TYPE
from ..outputs import Delta
from ..stream import RequestCancelled, RequestStream
from ..version import __version__
from .config import ServerConfig
from .errors import APIError, error_body, error_response, install, to_api_error
from .middleware import ApiKeyMiddleware, BodyLimitMiddleware
from .chat_stream import ChatPieces
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("kiln.server")
PROBES = frozenset({"/health", "/ready", "/metrics"})
SHUTDOWN_REASON = "abort"  # the finish reason of requests ended by a shutdown


def create_app(engine: Engine, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    app = FastAPI(title="Kiln", version=__version__)
    install(app, config.retry_after_s)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes, timeout_s=config.body_timeout_s)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key,
                           open_paths=frozenset() if config.api_key_all_routes else PROBES)
    created = int(time.time())

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} is not served here (this server serves {model_name!r})",
                           param="model", code="model_not_found")

    def unavailable(status: dict, detail: str) -> JSONResponse:
        return JSONResponse({**status, "detail": detail}, status_code=503,
                            headers={"Retry-After": str(config.retry_after_s)})

    @probe(app, "/health")
    async def health():
        state = engine.health()
        body = {"status": "ok" if state.ok else "unhealthy", "model": model_name, "draining": engine.draining,
                **asdict(engine.stats())}
        return JSONResponse(body) if state.ok else unavailable(body, state.detail)

    @probe(app, "/ready")
    async def ready():
        state = engine.health()
        if not state.ok:
            return unavailable({"status": "unhealthy"}, state.detail)
        if engine.draining:
            return unavailable({"status": "draining"}, "the server is shutting down")
        return {"status": "ready", "model": model_name}

    @probe(app, "/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kiln"}]}

    @probe(app, "/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of is not supported (use n)", param="best_of")
        params = body.sampling_params(default_max_tokens=16, logprobs=body.logprobs)
        rid, model = f"cmpl-{uuid.uuid4().hex}", model_name
        stream = await _submit(engine, rid, body.prompt, params, body.priority)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage

            def chunks(delta: Delta) -> list[dict]:
                if not (delta.text or delta.finish_reason or delta.logprobs):
                    return []
                return [{"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                         "choices": [{"index": delta.index, "text": delta.text,
                                      "logprobs": _completion_logprobs(engine, [delta.logprobs])
                                      if delta.logprobs else None,
                                      "finish_reason": delta.finish_reason}]}]

            return _sse(stream, chunks, config, usage and (lambda: {
                "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [], "usage": _usage(stream)}))
        out = await _collect(stream, request)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                             "logprobs": _completion_logprobs(engine, c.logprobs) if c.logprobs else None}
                            for c in out.choices],
                "usage": _usage(stream)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        top = body.top_logprobs or 0
        params = body.sampling_params(default_max_tokens=body.max_completion_tokens or 256,
                                      logprobs=top if body.logprobs else None)
        if body.max_completion_tokens and not body.max_tokens:
            params = params.replace(max_tokens=body.max_completion_tokens)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        rid, model = f"chatcmpl-{uuid.uuid4().hex}", model_name
        stream = await _submit(engine, rid, messages, params, body.priority, tools=body.tools,
                               tool_choice=body.tool_choice)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            pieces = ChatPieces(stream.tool_use)

            def chunks(delta: Delta) -> list[dict]:
                logprobs = {"content": _chat_logprobs(engine, [delta.logprobs])} if delta.logprobs else None
                return [{"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                         "choices": [{"index": delta.index, "delta": piece, "logprobs": logprobs if i == 0 else None,
                                      "finish_reason": finish}]}
                        for i, (piece, finish) in enumerate(pieces.of(delta))]

            return _sse(stream, chunks, config, usage and (lambda: {
                "id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [], "usage": _usage(stream)}))
        out = await _collect(stream, request)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": c.index, "message": _message(c), "finish_reason": c.finish_reason,
                             "logprobs": {"content": _chat_logprobs(engine, c.logprobs)} if c.logprobs else None}
                            for c in out.choices],
                "usage": _usage(stream)}

    return app


def probe(app: FastAPI, path: str):
    """A GET route that answers HEAD too (HEAD left out of the schema: one operation)."""
    def register(fn):
        app.head(path, include_in_schema=False, name=f"{fn.__name__}_head")(fn)
        return app.get(path)(fn)

    return register


async def _submit(engine: Engine, request_id: str, prompt, params, priority: int, **tools) -> RequestStream:
    """Tokenize, render, compile any grammar and queue in a worker thread: the event loop
    never does any of it."""
    submit = functools.partial(engine.submit, prompt, params, priority=priority, request_id=request_id, **tools)
    try:
        return await anyio.to_thread.run_sync(submit)
    except KilnError as err:
        raise to_api_error(err) from None
    except BaseException:
        # Cancelled (the client left) while the thread ran: the thread still queued the
        # request, and nobody will read it.
        engine.abort(request_id)
        raise


def _usage(stream: RequestStream) -> dict:
    out = stream.completion()
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


async def _collect(stream: RequestStream, request: Request):
    """Wait for a whole completion; a client that disconnects meanwhile cancels it."""

    async def watch():
        # After the body, receive() returns only when the client disconnects.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client of request %s disconnected", stream.request_id)
        stream.cancel()

    watcher = asyncio.create_task(watch())
    try:
        async for _ in stream:
            pass
    except RequestCancelled:
        raise APIError(499, "the client closed the request", type_="client_closed") from None
    except KilnError as err:
        raise to_api_error(err) from None
    finally:
        watcher.cancel()
    out = stream.completion()
    if any(c.finish_reason == SHUTDOWN_REASON for c in out.choices):
        raise APIError(503, "the server shut down before the request finished; retry it",
                       type_="service_unavailable", code="shutting_down")
    return out


def _sse(stream: RequestStream, chunks, config: ServerConfig, final=None) -> EventSourceResponse:
    """Server-sent events: one ``data:`` event per chunk ``chunks(delta)`` makes of each delta
    (none for a delta with nothing to say); then the usage chunk if asked for, and ``[DONE]``. An error ends the stream
    with an error event. sse-starlette sends keep-alive comments while nothing is
    generated and cancels the stream (and so the request) when the client disconnects."""

    async def events():
        try:
            async for delta in stream:
                for chunk in chunks(delta):
                    yield {"data": json.dumps(chunk, ensure_ascii=False)}
            if final:
                yield {"data": json.dumps(final())}
        except RequestCancelled:
            return
        except KilnError as err:  # the stream carries the error to the client
            api = to_api_error(err)
            yield {"data": json.dumps(error_body(api.message, api.type, api.param, api.code))}
        yield {"data": "[DONE]"}

    return EventSourceResponse(events(), ping=config.sse_ping_s, headers={"Cache-Control": "no-cache"})


def _message(choice) -> dict:
    message = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in choice.tool_calls]
    return message


def _token_text(engine: Engine, token: int) -> str:
    return engine.tokenizer.decode([token], skip_special_tokens=False)


def _completion_logprobs(engine: Engine, items) -> dict:
    tokens = [_token_text(engine, lp.token) for lp in items]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [_top_by_text(engine, lp.top) for lp in items], "text_offset": offsets}


def _top_by_text(engine: Engine, top) -> dict[str, float]:
    """The legacy format keys alternatives by text; tokens whose text collides (partial
    UTF-8 bytes decode alike) are keyed by their vocabulary piece instead."""
    out: dict[str, float] = {}
    for token, logprob in top:
        key = _token_text(engine, token)
        if key in out:
            key = engine.tokenizer.token_text(token) or f"<token {token}>"
        out[key] = logprob
    return out


def _chat_logprobs(engine: Engine, items) -> list[dict]:
    def entry(token: int, logprob: float) -> dict:
        text = _token_text(engine, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items]


__all__ = ["create_app", "error_response"]

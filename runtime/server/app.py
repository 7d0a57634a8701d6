"""The OpenAI-compatible HTTP API over one engine.

    POST /v1/completions        prompt (string or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models             the one served model
    GET  /health                liveness and engine load
    GET  /metrics               Prometheus text: TTFT, inter-token latency, queue, KV pages, tokens/s

A client that disconnects (mid-stream or while waiting for a full response) cancels its
request, which frees its KV pages. Malformed bodies get 400 naming the field, a full
queue 429; no bad request affects the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..engine import Engine
from ..errors import KilnError
from ..outputs import Delta
from ..stream import RequestCancelled, RequestStream
from ..version import __version__
from .errors import APIError, error_body, install, to_api_error
from .protocol import ChatCompletionRequest, CompletionRequest

DISCONNECT_POLL_S = 0.25
log = logging.getLogger("kiln.server")


def create_app(engine: Engine, model_name: str) -> FastAPI:
    app = FastAPI(title="Kiln", version=__version__)
    install(app)
    created = int(time.time())

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} is not served here (this server serves {model_name!r})",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, **engine.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kiln"}]}

    @app.get("/metrics")
    async def metrics():
        stats = engine.stats()
        gauges = {"queue_depth": stats["waiting"], "running_requests": stats["running"],
                  "kv_pages_total": stats["kv_pages_total"], "kv_pages_used": stats["kv_pages_used"],
                  "kv_page_usage_ratio": stats["kv_pages_used"] / max(stats["kv_pages_total"], 1)}
        return PlainTextResponse(engine.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of is not supported (use n)", param="best_of")
        params = body.sampling_params(default_max_tokens=16, logprobs=body.logprobs)
        stream = _submit(engine, body.prompt, params, body.priority)
        rid, model = f"cmpl-{uuid.uuid4().hex}", model_name
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage

            def chunk(delta: Delta) -> dict:
                return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                        "choices": [{"index": delta.index, "text": delta.text,
                                     "logprobs": _completion_logprobs(engine, [delta.logprobs])
                                     if delta.logprobs else None,
                                     "finish_reason": delta.finish_reason}]}

            return _sse(stream, chunk, request, usage and (lambda: {
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
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        stream = _submit(engine, messages, params, body.priority)
        rid, model = f"chatcmpl-{uuid.uuid4().hex}", model_name
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            started: set[int] = set()

            def chunk(delta: Delta) -> dict:
                piece = {} if delta.finish_reason and not delta.text else {"content": delta.text}
                if delta.index not in started:
                    started.add(delta.index)
                    piece = {"role": "assistant", **({"content": delta.text} if delta.text else {"content": ""})}
                return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                        "choices": [{"index": delta.index, "delta": piece,
                                     "logprobs": {"content": _chat_logprobs(engine, [delta.logprobs])}
                                     if delta.logprobs else None,
                                     "finish_reason": delta.finish_reason}]}

            return _sse(stream, chunk, request, usage and (lambda: {
                "id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [], "usage": _usage(stream)}))
        out = await _collect(stream, request)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason,
                             "logprobs": {"content": _chat_logprobs(engine, c.logprobs)} if c.logprobs else None}
                            for c in out.choices],
                "usage": _usage(stream)}

    return app


def _submit(engine: Engine, prompt, params, priority: int) -> RequestStream:
    try:
        return engine.submit(prompt, params, priority=priority)
    except KilnError as err:
        raise to_api_error(err) from None


def _usage(stream: RequestStream) -> dict:
    out = stream.completion()
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


async def _watch(request: Request, stream: RequestStream) -> None:
    while not stream.done:
        if await request.is_disconnected():
            log.info("client of request %s disconnected", stream.request_id)
            stream.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _collect(stream: RequestStream, request: Request):
    watcher = asyncio.create_task(_watch(request, stream))
    try:
        async for _ in stream:
            pass
    except RequestCancelled:
        raise APIError(499, "the client closed the request", type_="client_closed") from None
    except KilnError as err:
        raise to_api_error(err) from None
    finally:
        watcher.cancel()
    return stream.completion()


def _sse(stream: RequestStream, chunk, request: Request, final=None) -> StreamingResponse:
    async def events():
        watcher = asyncio.create_task(_watch(request, stream))
        try:
            async for delta in stream:
                if delta.text or delta.finish_reason or delta.logprobs:
                    yield f"data: {json.dumps(chunk(delta), ensure_ascii=False)}\n\n"
            if final:
                yield f"data: {json.dumps(final())}\n\n"
            yield "data: [DONE]\n\n"
        except RequestCancelled:
            return
        except KilnError as err:  # the stream carries the error to the client
            api = to_api_error(err)
            yield f"data: {json.dumps(error_body(api.message, api.type, api.param, api.code))}\n\n"
        finally:
            watcher.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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


__all__ = ["create_app", "JSONResponse"]

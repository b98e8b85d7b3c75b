"""The HTTP side of `redrafter-mlx serve`: OpenAI's routes on FastAPI, JSON errors, streaming as server-sent events.

    GET  /                      a chat page that colours each token by where it came from
    GET  /health                liveness and load
    GET  /v1/models             the served model
    POST /v1/chat/completions   chat (stream or not)
    POST /v1/completions        raw text (stream or not)

Every failure is OpenAI's JSON error object with its status; nothing here touches MLX (the scheduler does).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from mlx_redrafter import api
from mlx_redrafter.errors import UserError
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.server import protocol
from mlx_redrafter.server.protocol import ApiError
from mlx_redrafter.server.scheduler import Event, Job, Scheduler

MAX_BODY = 1 << 20  # bytes of a request body


def create_app(lm: api.LoadedModel, scheduler: Scheduler, base: DecodeOptions, api_key: str | None = None) -> FastAPI:
    """The app serving `lm` through `scheduler`; `base` holds the server's decoding defaults."""
    app = FastAPI(title="redrafter-mlx", docs_url=None, redoc_url=None, openapi_url=None)
    served = lm.target.name
    started = int(time.time())

    @app.middleware("http")
    async def limits(request: Request, call_next: Any) -> Response:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
            return _error(ApiError(413, f"the request body is larger than {MAX_BODY} bytes"))
        if api_key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                   kind="authentication_error"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind=kind))

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception) -> JSONResponse:
        return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served, **scheduler.load()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served, "object": "model", "created": started,
                                            "owned_by": "redrafter-mlx", "drafter": lm.drafter_name}]}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return resources.files("mlx_redrafter.server").joinpath("page.html").read_text(encoding="utf-8")

    async def complete(request: Request, kind: str) -> Response:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        req = protocol.parse(body, kind, served, base)
        ids = _encode(lm, req)
        job = Job(ids, req.options, req.stop, asyncio.get_running_loop())
        scheduler.submit(job)
        if req.stream:
            return StreamingResponse(_stream(req, job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text, finish, use = [], "stop", {}
            while True:
                ev = await job.queue.get()
                if ev.kind == "text":
                    text += [t for t, _ in ev.pieces]
                elif ev.kind == "done":
                    finish, use = ev.finish, ev.usage
                    break
                else:
                    raise ev.error
            return JSONResponse(protocol.completion(req, "".join(text), finish, use))
        finally:
            job.cancel()  # a client that went away while waiting stops its request

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "text")

    return app


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _encode(lm: api.LoadedModel, req: protocol.Request) -> list[int]:
    """Prompt ids (chat template or raw text), checked against the context and the draft mode's needs."""
    try:
        tok = lm.tokenizer
        ids = tok.encode_chat(req.messages) if req.kind == "chat" else tok.encode(req.prompt)
        api.draft_mode(lm, req.options)  # a mode this server's drafter cannot serve: 400 now
    except UserError as e:
        raise ApiError(400, str(e)) from None
    ctx = lm.target.model.args.max_position_embeddings
    if not ids:
        raise ApiError(400, "the prompt is empty")
    if len(ids) >= ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten it",
                       "messages" if req.kind == "chat" else "prompt")
    return ids


async def _stream(req: protocol.Request, job: Job) -> AsyncIterator[str]:
    """Server-sent events: chunks as the scheduler decides tokens, then [DONE]; the job stops if the client goes."""
    first = True
    try:
        while True:
            ev: Event = await job.queue.get()
            if ev.kind == "text":
                for text, origin in ev.pieces:
                    yield _sse(protocol.chunk(req, text, origin={"origin": origin}, first=first))
                    first = False
            elif ev.kind == "done":
                yield _sse(protocol.chunk(req, "", finish=ev.finish, first=first))
                if req.include_usage:
                    yield _sse({**protocol.chunk(req, ""), "choices": [], "usage": ev.usage})
                yield "data: [DONE]\n\n"
                return
            else:
                yield _sse(ev.error.body())
                return
    finally:
        job.cancel()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

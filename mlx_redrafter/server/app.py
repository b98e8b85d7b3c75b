"""The HTTP side of `redrafter-mlx serve`: OpenAI's routes on FastAPI, JSON errors, streaming as server-sent events.

    GET  /                      a chat page that colours each token by where it came from
    GET  /health                liveness and load
    GET  /v1/models             the served model
    GET  /v1/models/{id}        the served model by its id (404 for any other)
    POST /v1/chat/completions   chat (stream or not)
    POST /v1/completions        raw text (stream or not)

Every failure is OpenAI's JSON error object with its status; nothing here touches MLX (the scheduler does).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_redrafter import api
from mlx_redrafter.errors import UserError
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.schema import shown
from mlx_redrafter.server import protocol
from mlx_redrafter.server.protocol import ApiError
from mlx_redrafter.server.scheduler import Event, Job, Scheduler

MAX_BODY = 1 << 20  # bytes of a request body
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def create_app(lm: api.LoadedModel, scheduler: Scheduler, base: DecodeOptions, api_key: str | None = None) -> FastAPI:
    """The app serving `lm` through `scheduler`; `base` holds the server's decoding defaults."""
    app = FastAPI(title="redrafter-mlx", docs_url=None, redoc_url=None, openapi_url=None)
    served = lm.target.name
    started = int(time.time())

    app.add_middleware(_Gate, api_key=api_key)

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

    model = {"id": served, "object": "model", "created": started, "owned_by": "redrafter-mlx",
             "drafter": lm.drafter_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id != served:
            raise ApiError(404, f"model {shown(model_id)} is not served here; this server serves {served!r}", "model",
                           "not_found_error")
        return model

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return resources.files("mlx_redrafter.server").joinpath("page.html").read_text(encoding="utf-8")

    async def complete(request: Request, kind: str) -> Response:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
        req = protocol.parse(_json(raw), kind, served, base)
        ids = _encode(lm, req)
        job = Job(ids, _fit(lm, req, len(ids)), req.stop, asyncio.get_running_loop(), score_prompt=req.echo)
        scheduler.submit(job)
        wire = protocol.Logprobs(req, lm.tokenizer) if req.options.logprobs is not None else None
        if req.stream:
            return StreamingResponse(_stream(req, job, wire, ids[0]), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await _answer(request, req, job, wire, ids[0])
        finally:
            job.cancel()  # a client that went away while waiting stops its request

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "text")

    return app


class _Gate:
    """Refuses a request before its route runs: a body over MAX_BODY (413), a missing or wrong API key on /v1/
    (401). Plain ASGI, so that a route still sees its client disconnect (`Request.is_disconnected`)."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = _refusal(Headers(scope=scope), scope["path"], self.api_key)
            if refusal is not None:
                await _error(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(headers: Headers, path: str, api_key: str | None) -> ApiError | None:
    size = headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
        return ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
    if api_key and path.startswith("/v1/") and not _authorized(headers.get("authorization"), api_key):
        return ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", kind="authentication_error")
    return None


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _authorized(header: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries `api_key` as a bearer token (scheme in any case, compared in
    constant time)."""
    scheme, _, token = (header or "").strip().partition(" ")
    given = token.strip().encode("latin-1")  # the header's own bytes (HTTP headers arrive decoded as latin-1)
    return scheme.lower() == "bearer" and hmac.compare_digest(given, api_key.encode("utf-8", "surrogateescape"))


def _json(raw: bytes) -> Any:
    """The parsed request body; a 400 for anything that is not JSON (or nests too deeply to parse)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None


def _encode(lm: api.LoadedModel, req: protocol.Request) -> list[int]:
    """Prompt ids (chat template or raw text), checked against the context and the draft mode's needs."""
    tok = lm.tokenizer
    if req.prompt_ids is not None:
        try:
            ids = tok.check_ids(req.prompt_ids, "the prompt's token ids")
        except UserError as e:
            raise ApiError(400, str(e), "prompt") from None
        req.prompt = tok.decode(ids)  # what `echo` sends back
    try:
        if req.prompt_ids is None:
            ids = tok.encode_chat(req.messages) if req.kind == "chat" else tok.encode(req.prompt)
        api.check_for_model(lm, req.options)  # e.g. a mode this server's drafter cannot serve: 400 now
    except UserError as e:
        raise ApiError(400, protocol.field_names(str(e))) from None
    ctx = lm.target.model.args.max_position_embeddings
    if not ids:
        raise ApiError(400, "the prompt is empty")
    if len(ids) >= ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten it",
                       "messages" if req.kind == "chat" else "prompt")
    return ids


def _fit(lm: api.LoadedModel, req: protocol.Request, prompt_tokens: int) -> DecodeOptions:
    """The request's options with max_tokens within the room the context leaves after the prompt: a request that
    asks for more is a 400 (as vLLM answers), the server's default is cut to fit."""
    ctx = lm.target.model.args.max_position_embeddings
    room = ctx - prompt_tokens
    asked = req.options.max_tokens
    if req.max_tokens_field is not None and asked > room:
        raise ApiError(400, f"{req.max_tokens_field} is {asked} but at most {room} new tokens fit: the model's context "
                            f"is {ctx} tokens and the prompt has {prompt_tokens}", req.max_tokens_field)
    return req.options.updated(max_tokens=min(asked, room))


async def _answer(request: Request, req: protocol.Request, job: Job, wire: protocol.Logprobs | None,
                  first: int) -> Response:
    """The whole answer once the job is done (with its tokens' log-probabilities through `wire`; with `echo`, the
    prompt's first, whose id is `first`, and the rest); an empty response if the client went away first (the
    caller cancels the job)."""
    text, finish, use, logprobs, scored = [req.prompt] if req.echo else [], "stop", {}, [], None
    last_check = [time.monotonic()]
    while True:
        ev = await _next_event(request, job, last_check)
        if ev is None:
            return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
        if ev.kind == "text":
            text += [t for t, _ in ev.pieces]
            logprobs += ev.logprobs
            scored = ev.prompt_logprobs if ev.prompt_logprobs is not None else scored
        elif ev.kind == "done":
            finish, use = ev.finish, ev.usage
            break
        else:
            raise ev.error
    answer = None
    if wire is not None:
        answer = wire.wire(logprobs) if scored is None else protocol.joined(wire.prompt(first, scored),
                                                                          wire.wire(logprobs))
    return JSONResponse(protocol.completion(req, "".join(text), finish, use, answer))


async def _next_event(request: Request, job: Job, last_check: list[float]) -> Event | None:
    """The job's next event, or None once the client has disconnected. The client is checked at least every
    DISCONNECT_POLL_S, also while events keep arriving (`last_check` holds the time of the last check)."""
    get = asyncio.ensure_future(job.queue.get())
    try:
        while True:
            done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
            now = time.monotonic()
            if done and now - last_check[0] < DISCONNECT_POLL_S:
                return get.result()
            last_check[0] = now
            if await request.is_disconnected():
                return None
            if done:
                return get.result()
    finally:
        get.cancel()


async def _stream(req: protocol.Request, job: Job, wire: protocol.Logprobs | None,
                  first_id: int) -> AsyncIterator[str]:
    """Server-sent events: chunks as the scheduler decides tokens, then [DONE]; the job stops if the client goes.
    With `wire`, an event's first chunk carries the log-probabilities of the tokens it came from (a chunk with no
    text where a stop string holds the text back). With `echo`, the first chunk is the prompt (its first token's
    id is `first_id`)."""
    first = True
    try:
        while True:
            ev: Event = await job.queue.get()
            if req.echo and first and ev.kind != "error":  # the prompt, even before an answer that is only eos
                scored = None if wire is None or ev.prompt_logprobs is None else wire.prompt(first_id,
                                                                                             ev.prompt_logprobs)
                yield _sse(protocol.chunk(req, req.prompt, origin={"origin": "prompt"}, logprobs=scored))
                first = False
            if ev.kind == "text":
                logprobs = None if wire is None or not ev.logprobs else wire.wire(ev.logprobs)
                for text, origin in ev.pieces or [("", "target")]:
                    yield _sse(protocol.chunk(req, text, origin={"origin": origin}, first=first, logprobs=logprobs))
                    first, logprobs = False, None
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

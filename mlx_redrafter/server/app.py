"""The HTTP side of `redrafter-mlx serve`: OpenAI's routes on FastAPI, JSON errors, streaming as server-sent events.

    GET  /                      a chat page that colours each token by where it came from
    GET  /health                liveness and load
    GET  /v1/models             the served model
    GET  /v1/models/{id}        the served model by its id (404 for any other)
    POST /v1/chat/completions   chat (stream or not)
    POST /v1/completions        raw text (stream or not)
    POST /tokenize              token ids of a prompt or a chat, as the completions routes would see them
    POST /detokenize            text of token ids
    GET  /metrics               Prometheus metrics: completions, tokens, latency, target calls, accepted drafts

Every failure is OpenAI's JSON error object with its status; nothing here touches MLX (the scheduler does).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_redrafter import api
from mlx_redrafter.errors import UserError
from mlx_redrafter.logprobs import TokenLogprob
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.schema import shown
from mlx_redrafter.server import protocol
from mlx_redrafter.server.protocol import ApiError
from mlx_redrafter.server.scheduler import Event, Job, Scheduler
from mlx_redrafter.server.tools import CallStream, Reply, template_messages

MAX_BODY = 1 << 20  # bytes of a request body
# the routes an --api-key guards (the page and /health stay open)
GATED = ("/v1/", "/tokenize", "/detokenize", "/metrics")
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

    @app.get("/metrics")
    async def metrics() -> Response:
        load = scheduler.load()
        return Response(scheduler.metrics.render(load["active"], load["waiting"]),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

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
        req = protocol.parse(await _body(request), kind, served, base)
        prompts = _encode(lm, req)
        if len(prompts) * req.n > scheduler.capacity:
            raise ApiError(400, f"the request asks for {len(prompts) * req.n} completions but this server holds at "
                                f"most {scheduler.capacity} at once (running and waiting): ask for fewer",
                           "n" if req.n > 1 else "prompt")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, _choice_options(_fit(lm, req, len(ids)), k), req.stop, loop, score_prompt=req.echo,
                    queue=queue, index=p * req.n + k)
                for p, ids in enumerate(prompts) for k in range(req.n)]
        scheduler.submit(*jobs)
        choices = [_Choice(req, lm, p, ids[0]) for p, ids in enumerate(prompts) for _ in range(req.n)]
        if req.stream:
            return StreamingResponse(_stream(req, jobs, choices), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            return await _answer(request, req, jobs, choices)
        finally:
            for job in jobs:
                job.cancel()  # a client that went away while waiting stops its request

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "text")

    ctx = lm.target.model.args.max_position_embeddings

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = protocol.parse_tokenize(await _body(request), served)
        tok = lm.tokenizer
        if req.messages is not None:
            ids = _user(tok.encode_chat, template_messages(req.messages, req.tools))
        else:
            ids = _user(tok.encode, req.prompt)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx, "tokens": ids}
        if req.token_strs:
            out["token_strs"] = [tok.backend.id_to_token(i) for i in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        ids = protocol.parse_detokenize(await _body(request), served)
        try:
            ids = lm.tokenizer.check_ids(ids, "'tokens'")
        except UserError as e:
            raise ApiError(400, str(e), "tokens") from None
        return {"prompt": lm.tokenizer.decode(ids)}

    return app


class _Gate:
    """Refuses a request before its route runs: a body over MAX_BODY (413), a missing or wrong API key on a GATED
    route (401). Plain ASGI, so that a route still sees its client disconnect (`Request.is_disconnected`)."""

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
    if api_key and path.startswith(GATED) and not _authorized(headers.get("authorization"), api_key):
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


async def _body(request: Request) -> Any:
    """The parsed request body; a 413 for one over MAX_BODY (sent without a length), a 400 for anything that is not
    JSON (or nests too deeply to parse)."""
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None


def _encode(lm: api.LoadedModel, req: protocol.Request) -> list[list[int]]:
    """Each prompt's ids (chat template or raw text), checked against the context and the draft mode's needs."""
    tok = lm.tokenizer
    try:
        api.check_for_model(lm, req.options)  # e.g. a mode this server's drafter cannot serve: 400 now
    except UserError as e:
        raise ApiError(400, protocol.field_names(str(e))) from None
    if req.options.prediction:
        req.prediction_tokens = len(_user(tok.encode, req.options.prediction))
    if req.kind == "chat":
        return [_checked_length(lm, _user(tok.encode_chat, template_messages(req.messages, req.tools)),
                                "messages")]
    out = []
    for i, given in enumerate(req.prompt_ids):
        if given is not None:
            where = "the prompt's token ids" if len(req.prompt_ids) == 1 else f"prompt[{i}]'s token ids"
            try:
                ids = tok.check_ids(given, where)
            except UserError as e:
                raise ApiError(400, str(e), "prompt") from None
            req.prompts[i] = tok.decode(ids)  # what `echo` sends back
        else:
            ids = _user(tok.encode, req.prompts[i])
        out.append(_checked_length(lm, ids, "prompt"))
    return out


def _user(encode: Callable[[Any], list[int]], text: Any) -> list[int]:
    """`encode(text)`, a 400 for what the tokenizer refuses."""
    try:
        return encode(text)
    except UserError as e:
        raise ApiError(400, protocol.field_names(str(e))) from None


def _checked_length(lm: api.LoadedModel, ids: list[int], field: str) -> list[int]:
    ctx = lm.target.model.args.max_position_embeddings
    if not ids:
        raise ApiError(400, "the prompt is empty")
    if len(ids) >= ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten it", field)
    return ids


def _choice_options(options: DecodeOptions, k: int) -> DecodeOptions:
    """The options of a prompt's k-th choice: a seeded request's choices draw from seed, seed + 1, ... (as vLLM
    seeds a request's `n` samples), so that they differ and each is reproducible."""
    seed = options.sampling.seed
    return options if k == 0 or seed is None else options.updated(seed=(seed + k) % (1 << 63))


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


class _Choice:
    """What the HTTP side keeps of one choice while it arrives: its prompt (for `echo`) and the log-probabilities'
    wire state."""

    def __init__(self, req: protocol.Request, lm: api.LoadedModel, prompt: int, first: int):
        self.prompt = req.prompts[prompt] if req.kind == "text" else ""
        self.first = first  # the prompt's first token id
        self.wire = protocol.Logprobs(req, lm.tokenizer) if req.options.logprobs is not None else None
        self.text: list[str] = [self.prompt] if req.echo else []
        self.logprobs: list[TokenLogprob] = []
        self.scored: list[TokenLogprob] | None = None
        self.ended: protocol.Ended | None = None
        self.started = False  # a chunk of it was streamed
        self.reply = Reply() if req.tools is not None else None  # with tools: a direct answer's text as it comes
        self.calls = CallStream() if req.tools is not None else None  # and the calls' arguments as they come

    def answer(self, req: protocol.Request, index: int) -> dict[str, Any]:
        """Its whole answer (with its tokens' log-probabilities; with `echo`, the prompt's first and the rest)."""
        lp = None
        if self.wire is not None:
            lp = self.wire.wire(self.logprobs) if self.scored is None else protocol.joined(
                self.wire.prompt(self.first, self.scored), self.wire.wire(self.logprobs))
        return protocol.choice(req, index, "".join(self.text), self.ended.finish, lp)


async def _answer(request: Request, req: protocol.Request, jobs: list[Job], choices: list[_Choice]) -> Response:
    """The whole answer once every job is done; an empty response if the client went away first (the caller
    cancels the jobs)."""
    last_check = [time.monotonic()]
    left = len(jobs)
    while left:
        ev = await _next_event(request, jobs[0].queue, last_check)
        if ev is None:
            return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
        c = choices[ev.choice]
        if ev.kind == "text":
            c.text += [t for t, _ in ev.pieces]
            c.logprobs += ev.logprobs
            c.scored = ev.prompt_logprobs if ev.prompt_logprobs is not None else c.scored
        elif ev.kind == "done":
            c.ended = ev.ended
            left -= 1
        else:
            raise ev.error
    return JSONResponse(protocol.completion(req, [c.answer(req, i) for i, c in enumerate(choices)],
                                            protocol.usage([c.ended for c in choices], req.n, req.prediction_tokens)))


async def _next_event(request: Request, queue: asyncio.Queue[Event], last_check: list[float]) -> Event | None:
    """The next event of a request's jobs, or None once the client has disconnected. The client is checked at
    least every DISCONNECT_POLL_S, also while events keep arriving (`last_check` holds the time of the last check)."""
    get = asyncio.ensure_future(queue.get())
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


async def _stream(req: protocol.Request, jobs: list[Job], choices: list[_Choice]) -> AsyncIterator[str]:
    """Server-sent events: chunks as the scheduler decides tokens (each naming its choice's index), then, once
    every choice is done, the usage (if asked) and [DONE]; the jobs stop if the client goes. With log-probabilities,
    an event's first chunk carries those of the tokens it came from (a chunk with no text where a stop string holds
    the text back). With `echo`, a choice's first chunk is its prompt."""
    left = len(jobs)
    try:
        while left:
            ev: Event = await jobs[0].queue.get()
            i, c = ev.choice, choices[ev.choice]
            if req.echo and not c.started and ev.kind != "error":  # the prompt, even before an answer of only eos
                scored = None if c.wire is None or ev.prompt_logprobs is None else c.wire.prompt(c.first,
                                                                                                 ev.prompt_logprobs)
                yield _sse(protocol.chunk(req, c.prompt, origin={"origin": "prompt"}, logprobs=scored, index=i))
                c.started = True
            if ev.kind == "text" and c.reply is not None:  # JSON: a direct answer's text or the calls stream
                c.text += [t for t, _ in ev.pieces]
                c.logprobs += ev.logprobs
                raw = "".join(t for t, _ in ev.pieces)
                piece, calls = c.reply.feed(raw), c.calls.feed(raw)
                origin = {"origin": ev.pieces[-1][1]} if ev.pieces else None
                if piece or calls:
                    yield _sse(protocol.chunk(req, piece, origin=origin, first=not c.started, index=i,
                                              calls=[p.wire() for p in calls] if calls else None))
                    c.started = True
            elif ev.kind == "text":
                logprobs = None if c.wire is None or not ev.logprobs else c.wire.wire(ev.logprobs)
                for text, origin in ev.pieces or [("", "target")]:
                    yield _sse(protocol.chunk(req, text, origin={"origin": origin}, first=not c.started,
                                              logprobs=logprobs, index=i))
                    c.started, logprobs = True, None
            elif ev.kind == "done":
                finish = ev.ended.finish
                if c.reply is not None:
                    message, finish = protocol.answer_message(req, "".join(c.text), finish)
                    logprobs = None if c.wire is None or not c.logprobs else c.wire.wire(c.logprobs)
                    if c.reply.began:  # its text has streamed: what is left of it, and the log-probabilities
                        rest = message["content"][len(c.reply.text):]
                        if rest or logprobs is not None:
                            yield _sse(protocol.chunk(req, rest, first=not c.started, index=i, logprobs=logprobs))
                    elif c.calls.calls or c.calls.in_arguments:  # the calls have streamed
                        if logprobs is not None:
                            yield _sse(protocol.chunk(req, "", index=i, logprobs=logprobs))
                    else:
                        yield _sse(protocol.chunk(req, "", index=i, message=message, logprobs=logprobs))
                    c.started = True
                yield _sse(protocol.chunk(req, "", finish=finish, first=not c.started, index=i))
                c.ended, c.started = ev.ended, True
                left -= 1
            else:
                yield _sse(ev.error.body())
                return
        if req.include_usage:
            yield _sse({**protocol.chunk(req, ""), "choices": [],
                        "usage": protocol.usage([c.ended for c in choices], req.n, req.prediction_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            job.cancel()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

"""An OpenAI-compatible HTTP server on the continuous batching engine (lesson 09).

    python -m minillm serve --model smollm2 --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="smollm2", messages=[...], stream=True)

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events or not), GET /health, GET /debug/engine (KV block and request counters).

Architecture: the engine is not thread-safe, so exactly one thread owns it.

    uvicorn's event loop (async handlers)               EngineWorker thread (owns llm.engine)
    parse + validate + tokenise -> Request
    worker.submit(req, sink)  ----- inbox queue ----->  add_request(req)
                                                        step() -> (req, delta) for each request
    await sink's asyncio.Queue <- call_soon_threadsafe   push Delta(text, finish_reason) to its sink
    client went away: worker.abort(id)  --- inbox --->  abort_request(id): its KV blocks are freed

Every concurrent HTTP request therefore shares one batch: the scheduler admits new requests
at the next step, exactly as it does offline.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from .request import Request
from .sampling import SamplingParams

log = logging.getLogger("minillm.server")
DISCONNECT_POLL_S = 0.25            # how often a non-streaming handler checks that its client is still there

# OpenAI fields minillm does not implement: accepted only at values that change nothing.
UNSUPPORTED_FIELDS = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
}


# ---- errors -------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 (bad JSON, wrong types) as OpenAI's 400, naming the first offending field."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    path = [str(part) for part in first["loc"][1:]]               # loc is ("body", field, ...)
    return APIError(400, f"{'.'.join(path) or 'body'}: {first['msg']}", param=path[0] if path else None)


async def _error_response(_http: HTTPRequest, exc: Exception) -> JSONResponse:
    if isinstance(exc, RequestValidationError):
        exc = _validation_error(exc)
    elif isinstance(exc, StarletteHTTPException):                 # unknown path, wrong method
        exc = APIError(exc.status_code, str(exc.detail))
    return exc.response()


# ---- request bodies (OpenAI's names; vLLM's extras top_k and ignore_eos) -------------------

class _RequestBody(BaseModel):
    model_config = ConfigDict(extra="allow")      # unknown OpenAI fields are ignored, as vLLM does

    model: str
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    top_k: int | None = None
    ignore_eos: bool = False

    def check_supported(self) -> None:
        for name, harmless in UNSUPPORTED_FIELDS.items():
            value = (self.model_extra or {}).get(name)
            if value not in harmless:
                raise APIError(400, f"{name} = {value!r} is not supported by minillm's server "
                                    f"(allowed: {' or '.join(map(repr, harmless))})", param=name)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(_RequestBody):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16                   # OpenAI's default for /v1/completions


class ChatBody(_RequestBody):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None                 # None: up to the end of the context
    max_completion_tokens: int | None = None      # OpenAI's newer name; wins over max_tokens


# ---- the engine thread --------------------------------------------------------------------

@dataclass(frozen=True)
class Delta:
    """What the engine thread tells a handler after a step: new text, and whether it is over."""
    text: str
    finish_reason: str | None          # "stop", "length", "abort"; None while running
    num_output_tokens: int
    error: str | None = None


@dataclass
class _Sink:
    """Where one request's deltas go: an asyncio.Queue owned by the handler's event loop."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def push(self, delta: Delta) -> None:
        with contextlib.suppress(RuntimeError):    # the loop has closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)


class EngineWorker:
    """The one thread that calls the engine. Others talk to it only through `inbox`."""

    _STOP = object()

    def __init__(self, llm):
        if llm.speculative_method is not None:
            raise ValueError("the server runs on the continuous batching engine; "
                             "speculative_method must be None")
        self.engine = llm.engine                  # built here: it allocates the KV pool
        self.inbox: queue.Queue = queue.Queue()
        self.sinks: dict[str, _Sink] = {}         # request_id -> sink, for requests in the engine
        self.counters = {"num_finished": 0, "num_aborted": 0, "num_failed": 0}
        self.stats = self._snapshot()
        self.thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)

    # called from other threads
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(self._STOP)
        self.thread.join()

    def submit(self, req: Request, sink: _Sink) -> None:
        self.inbox.put(("add", req, sink))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    # the engine thread
    def _run(self) -> None:
        while self._take_commands(wait=not self.engine.has_unfinished()):
            if self.engine.has_unfinished():
                self._step()
            self.stats = self._snapshot()

    def _take_commands(self, wait: bool) -> bool:
        """Apply every queued command (blocking for the first one when idle). False on stop."""
        commands = [self.inbox.get()] if wait else []
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self.inbox.get_nowait())
        for command in commands:
            if command is self._STOP:
                for request_id in list(self.sinks):
                    self._abort(request_id)
                return False
            if command[0] == "add":
                _, req, sink = command
                self.engine.add_request(req)
                self.sinks[req.request_id] = sink
            else:
                self._abort(command[1])
        return True

    def _abort(self, request_id: str) -> None:
        sink = self.sinks.pop(request_id, None)
        if sink is None:                          # it finished before the abort arrived
            return
        self.engine.abort_request(request_id)
        self.counters["num_aborted"] += 1
        sink.push(Delta("", "abort", 0))

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:                    # keep serving: fail the requests in flight, free their blocks
            log.exception("engine step failed")
            for request_id, sink in list(self.sinks.items()):
                self.engine.abort_request(request_id)
                sink.push(Delta("", None, 0, error=f"engine step failed: {e}"))
            self.counters["num_failed"] += len(self.sinks)
            self.sinks.clear()
            return
        for req, text in events:
            sink = self.sinks[req.request_id]
            sink.push(Delta(text, req.finish_reason, len(req.output_token_ids)))
            if req.finished:
                del self.sinks[req.request_id]
                self.counters["num_finished"] += 1

    def _snapshot(self) -> dict:
        """Counters published for /debug/engine, so that no other thread reads the engine itself."""
        bm = self.engine.block_manager
        return {"num_free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks,
                "num_requests": len(self.sinks), **self.counters}


# ---- one request seen from its handler -----------------------------------------------------

class EngineFailure(Exception):
    pass


class Job:
    """One Request in flight: submitted on creation, read as Deltas, aborted if abandoned."""

    def __init__(self, worker: EngineWorker, req: Request, model: str, id_prefix: str):
        self.worker, self.req, self.model = worker, req, model
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.finish_reason: str | None = None
        self.num_output_tokens = 0
        self._queue: asyncio.Queue = asyncio.Queue()
        worker.submit(req, _Sink(asyncio.get_running_loop(), self._queue))

    async def deltas(self) -> AsyncIterator[Delta]:
        while self.finish_reason is None:
            delta = await self._queue.get()
            if delta.error is not None:
                self.finish_reason = "error"
                raise EngineFailure(delta.error)
            self.finish_reason, self.num_output_tokens = delta.finish_reason, delta.num_output_tokens
            yield delta

    def abort(self) -> None:
        if self.finish_reason is None:
            self.worker.abort(self.req.request_id)

    def usage(self) -> dict:
        prompt = len(self.req.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.num_output_tokens,
                "total_tokens": prompt + self.num_output_tokens}

    def head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    async def text(self, http: HTTPRequest) -> str:
        """All of the output, aborting the request if the client hangs up while it waits."""
        watcher = asyncio.create_task(self._abort_on_disconnect(http))
        try:
            return "".join([delta.text async for delta in self.deltas()])
        finally:
            watcher.cancel()

    async def _abort_on_disconnect(self, http: HTTPRequest) -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.abort()


# ---- response shapes ----------------------------------------------------------------------

@dataclass(frozen=True)
class _Shape:
    """How one endpoint spells its responses (OpenAI's completion vs chat objects)."""
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish_reason: str | None) -> dict:
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None) -> dict:
        body = {"delta": {"content": text} if text else {}} if self.chat else {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}


COMPLETION = _Shape("cmpl", "text_completion", "text_completion", chat=False)
CHAT = _Shape("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _event_stream(job: Job, shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    head = job.head(shape.chunk_object)
    try:
        if shape.chat:                               # OpenAI opens a chat stream with the role
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        async for delta in job.deltas():
            if delta.text or delta.finish_reason:    # empty deltas: text held back (partial UTF-8, stop string)
                yield _sse({**head, "choices": [shape.chunk_choice(delta.text, delta.finish_reason)]})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": job.usage()})
    except EngineFailure as e:
        yield _sse(APIError(500, str(e), type="server_error").body())
    finally:                                         # the client disconnected mid-stream: free its blocks
        job.abort()
    yield "data: [DONE]\n\n"


# ---- the app ------------------------------------------------------------------------------

class OpenAIServer:
    """The endpoints, over one LLM whose engine the worker thread owns."""

    def __init__(self, llm, served_model_name: str):
        self.llm, self.model_name = llm, served_model_name
        self.worker = EngineWorker(llm)
        self.created = int(time.time())

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "minillm", "max_model_len": self.llm.max_model_len}]}

    async def health(self) -> dict:
        return {}

    async def debug_engine(self) -> dict:
        return self.worker.stats

    async def completions(self, body: CompletionBody, http: HTTPRequest):
        self._check(body)
        text, ids = self._completion_prompt(body.prompt)
        req = self._new_request(text, ids, body, body.max_tokens, "prompt")
        return await self._respond(Job(self.worker, req, self.model_name, COMPLETION.id_prefix),
                                   COMPLETION, body, http)

    async def chat_completions(self, body: ChatBody, http: HTTPRequest):
        self._check(body)
        text = self._chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = self._new_request(text, self.llm.get_tokenizer().encode(text), body, max_tokens, "messages")
        return await self._respond(Job(self.worker, req, self.model_name, CHAT.id_prefix), CHAT, body, http)

    # helpers
    def _check(self, body: _RequestBody) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")
        body.check_supported()

    def _completion_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.llm.get_tokenizer().encode(prompt)
        if all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        if len(prompt) == 1:
            return self._completion_prompt(prompt[0])
        raise APIError(400, f"minillm's server takes one prompt per request (a string or a list of "
                            f"token ids); got a list of {len(prompt)} prompts", param="prompt")

    def _chat_prompt(self, messages: list[dict]) -> str:
        """The chat template over messages whose content is a string or a list of text parts."""
        def text_of(content):
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                return "".join(str(p.get("text", "")) for p in content)
            if not isinstance(content, str):
                raise APIError(400, "message content must be a string or a list of {'type': 'text', 'text': ...} "
                                    "parts", param="messages")
            return content

        flat = [{**m, "content": text_of(m.get("content"))} for m in messages]
        try:
            return self.llm.get_tokenizer().apply_chat_template(flat, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e

    def _new_request(self, text: str | None, ids: list[int], body: _RequestBody,
                     max_tokens: int | None, prompt_field: str) -> Request:
        limit = self.llm.max_model_len
        if max_tokens is None:
            max_tokens = max(1, limit - len(ids))
        if len(ids) + max_tokens > limit:            # OpenAI refuses rather than truncating
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the request asks for "
                                f"{len(ids)} prompt tokens + max_tokens {max_tokens}. Shorten the "
                                f"{prompt_field} or lower max_tokens.", param=prompt_field,
                           code="context_length_exceeded")
        try:
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=-1 if body.top_k is None else body.top_k,
                max_tokens=max_tokens, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos)
            (req,) = self.llm.make_requests([{"prompt": text, "prompt_token_ids": ids}], params)
        except ValueError as e:
            raise APIError(400, str(e).replace("SamplingParams.", "")) from e
        return req

    async def _respond(self, job: Job, shape: _Shape, body: _RequestBody, http: HTTPRequest):
        if body.stream:
            return StreamingResponse(_event_stream(job, shape, body.include_usage), media_type="text/event-stream")
        try:
            text = await job.text(http)
        except EngineFailure as e:
            raise APIError(500, str(e), type="server_error") from e
        return {**job.head(shape.object), "choices": [shape.choice(text, job.finish_reason)], "usage": job.usage()}


def build_app(llm, served_model_name: str = "smollm2") -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread. app.state.server is the
    OpenAIServer, for in-process access to its worker."""
    server = OpenAIServer(llm, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        server.worker.start()
        yield
        server.worker.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.server = server
    for kind in (APIError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(kind, _error_response)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/debug/engine")(server.debug_engine)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    return app


def serve(llm, host: str = "127.0.0.1", port: int = 8000, served_model_name: str = "smollm2") -> None:
    """Serve in the foreground until Ctrl-C (python -m minillm serve)."""
    import uvicorn

    uvicorn.run(build_app(llm, served_model_name), host=host, port=port, log_level="info",
                timeout_graceful_shutdown=5)             # then open streams are cut and their requests aborted


class ServerThread:
    """uvicorn serving the app from a background thread, for tests, benchmarks and notebooks.

        with ServerThread(build_app(llm)) as server:     # port 0: the OS picks a free port
            openai.OpenAI(base_url=server.base_url, api_key="unused")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.app = app
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="minillm-http", daemon=True)
        self.url = self.base_url = None

    def start(self, timeout_s: float = 60.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (see the log above)")
            time.sleep(0.02)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.base_url = self.url + "/v1"
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

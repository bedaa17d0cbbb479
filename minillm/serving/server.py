"""An OpenAI-compatible HTTP server on the continuous batching engine (lesson 09).

    python -m minillm serve --model smollm2 --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="smollm2", messages=[...], stream=True)

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events or not), GET /health, GET /debug/engine (KV block and request counters).

Also GET /metrics (Prometheus text). With an API key, /v1/* wants `Authorization: Bearer KEY`.

Structured output (minillm/guided/api.py): response_format json_schema / json_object, vLLM's
guided_json / guided_regex / guided_choice / guided_grammar, and tools with tool_choice naming a function or
"required", answered as tool_calls (finish_reason "tool_calls"), streamed or not.

Architecture: the engine is not thread-safe, so exactly one thread steps it: the EngineWorker's loop
(minillm/engine/worker.py), which `serve` runs on its main thread, the one that loaded the model, while
uvicorn runs on a second thread (why the thread matters on a CPU: worker.py's docstring). This module
is the HTTP side: it validates, tokenises, submits a Request to the worker and streams the Deltas it
sends back, aborting the request when its client goes away. Every concurrent HTTP request therefore
shares one batch: the scheduler admits new requests at the next step, exactly as it does offline.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.engine.request import Request
from minillm.engine.sampling import SamplingParams
from minillm.engine.worker import Delta, EngineFailure, EngineWorker, QueueFull, _Sink
from minillm.guided.api import ToolCallPlan, guided_from_fields

DISCONNECT_POLL_S = 0.25            # how often a handler checks that its client is still there
MAX_BODY_BYTES = 1 << 20            # a chat that fills the context is a few tens of KiB of JSON
MAX_STOP_STRINGS = 16               # each one is searched for after every token
MAX_STOP_CHARS = 256

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
    # structured output (minillm/guided/api.py)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        """JSON may escape a lone UTF-16 surrogate ("\\ud800"): valid JSON, but no text can hold
        it (the tokenizer and every response that echoes it would fail with a 500)."""
        def strings(value):
            if isinstance(value, str):
                yield value
            elif isinstance(value, dict):
                for key, item in value.items():
                    yield from (*strings(key), *strings(item))
            elif isinstance(value, list):
                for item in value:
                    yield from strings(item)

        for text in strings(data):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string in the body is not valid Unicode (a lone surrogate such as "
                                 "\\ud800)") from None
        return data

    def check_supported(self) -> None:
        for name, harmless in UNSUPPORTED_FIELDS.items():
            value = (self.model_extra or {}).get(name)
            if value not in harmless:
                raise APIError(400, f"{name} = {value!r} is not supported by minillm's server "
                                    f"(allowed: {' or '.join(map(repr, harmless))})", param=name)

    def check_stop(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                                f"characters each", param="stop")

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


# ---- one request seen from its handler -----------------------------------------------------

class Job:
    """One Request in flight: submitted on creation, read as Deltas, aborted if abandoned."""

    def __init__(self, worker: EngineWorker, req: Request, model: str, id_prefix: str, http: HTTPRequest):
        self.worker, self.req, self.model = worker, req, model
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.finish_reason: str | None = None
        self.num_output_tokens = 0
        self._queue: asyncio.Queue = asyncio.Queue()
        try:
            worker.submit(req, _Sink(asyncio.get_running_loop(), self._queue))
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded") from e
        # watch the client from the start: a stream body that never starts runs no finally, and
        # servers on ASGI 2.4 do not tell Starlette that a streaming client has gone
        self._watcher = asyncio.create_task(self._abort_on_disconnect(http))

    async def deltas(self) -> AsyncIterator[Delta]:
        async for batch in self.delta_batches():
            for delta in batch:
                yield delta

    async def delta_batches(self) -> AsyncIterator[list[Delta]]:
        """The deltas that have arrived, as they arrive: waits for one, then takes every other one already queued
        (several tokens of one speculative step, or steps that came while the handler was busy), so that a stream
        writes them to its socket at once."""
        while self.finish_reason is None:
            batch = [await self._queue.get()]
            while batch[-1].finish_reason is None and batch[-1].error is None and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            error = batch.pop() if batch[-1].error is not None else None     # an error comes last
            if batch:
                self.finish_reason, self.num_output_tokens = batch[-1].finish_reason, batch[-1].num_output_tokens
                yield batch
            if error is not None:
                self.finish_reason = "error"
                raise EngineFailure(error.error, error.client_error)

    def abort(self) -> None:
        if self.finish_reason is None:
            self.worker.abort(self.req.request_id)

    def usage(self) -> dict:
        prompt = len(self.req.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.num_output_tokens,
                "total_tokens": prompt + self.num_output_tokens}

    def head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    async def text(self) -> str:
        """All of the output."""
        try:
            return "".join([delta.text async for delta in self.deltas()])
        finally:
            self.close()

    def close(self) -> None:
        """The handler is done with the request: abort it if it is still running (an error, a
        cancelled handler), as it would otherwise decode on to max_tokens."""
        self._watcher.cancel()
        self.abort()

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


async def _sse_stream(job: Job, head: dict, chunks: AsyncIterator[str], include_usage: bool) -> AsyncIterator[str]:
    """What every stream shares: its chunks, the usage chunk if asked, an engine error as an error event,
    the request closed whatever happens, and `data: [DONE]` at the end."""
    try:
        try:
            async for chunk in chunks:
                yield chunk
            if include_usage:
                yield _sse({**head, "choices": [], "usage": job.usage()})
        except EngineFailure as e:
            yield _sse(_engine_error(e).body())
    finally:
        job.close()
    yield "data: [DONE]\n\n"


def _event_stream(job: Job, shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    head = job.head(shape.chunk_object)

    async def chunks():
        if shape.chat:                               # OpenAI opens a chat stream with the role
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        async for batch in job.delta_batches():      # one write for the deltas that have arrived
            events = [_sse({**head, "choices": [shape.chunk_choice(delta.text, delta.finish_reason)]})
                      for delta in batch if delta.text or delta.finish_reason]   # empty: text held back
            if events:
                yield "".join(events)
    return _sse_stream(job, head, chunks(), include_usage)


def _tool_event_stream(job: Job, plan: ToolCallPlan, include_usage: bool) -> AsyncIterator[str]:
    """A tool call streamed as OpenAI does: the call's id and name first, then its arguments in
    pieces. With tool_choice "required" the name is only known at the end: one piece then."""
    head = job.head(CHAT.chunk_object)

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        return _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason}]})

    def call(**function) -> dict:
        return {"tool_calls": [{"index": 0, **function}]}

    async def chunks():
        yield chunk({"role": "assistant", "content": None})
        text = []
        if plan.named:
            name = plan.functions[0]["name"]
            yield chunk(call(id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                             function={"name": name, "arguments": ""}))
        async for delta in job.deltas():
            text.append(delta.text)
            if plan.named and delta.text:
                yield chunk(call(function={"arguments": delta.text}))
        if not plan.named and job.finish_reason == "stop":
            (whole,) = plan.tool_calls("".join(text))
            yield chunk(call(**whole))
        yield chunk({}, "tool_calls" if job.finish_reason == "stop" else job.finish_reason)
    return _sse_stream(job, head, chunks(), include_usage)


def _engine_error(e: EngineFailure) -> APIError:
    return APIError(400, str(e)) if e.client_error else APIError(500, str(e), type="server_error")


# ---- the app ------------------------------------------------------------------------------

class OpenAIServer:
    """The endpoints, over one LLM whose engine the worker thread owns."""

    def __init__(self, llm, served_model_name: str, max_waiting: int, stall_timeout_s: float):
        self.llm, self.model_name = llm, served_model_name
        self.worker = EngineWorker(llm, max_waiting)
        self.stall_timeout_s = stall_timeout_s
        self.created = int(time.time())

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "minillm", "max_model_len": self.llm.max_model_len}]}

    async def health(self) -> dict:
        """200 while the engine thread can serve: a load balancer takes a 503 server out."""
        if not self.worker.alive:
            raise APIError(503, "the engine's thread is not running (see the server log)", type="server_error")
        stalled = self.worker.stalled_for()
        if stalled > self.stall_timeout_s:
            raise APIError(503, f"the engine has made no progress for {stalled:.0f} s although requests wait",
                           type="server_error")
        return {}

    async def metrics(self) -> Response:
        return Response(generate_latest(self.worker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def debug_engine(self) -> dict:
        return self.worker.stats

    async def completions(self, body: CompletionBody, http: HTTPRequest):
        self._check(body)
        if body.tools:
            raise APIError(400, "tools are answered by /v1/chat/completions, not /v1/completions", param="tools")
        guided, _ = self._guided(body)
        text, ids = self._completion_prompt(body.prompt)
        req = self._new_request(text, ids, body, body.max_tokens, "prompt", guided)
        return await self._respond(Job(self.worker, req, self.model_name, COMPLETION.id_prefix, http),
                                   COMPLETION, body, http)

    async def chat_completions(self, body: ChatBody, http: HTTPRequest):
        self._check(body)
        guided, plan = self._guided(body)
        messages = body.messages
        if plan is not None:            # the model learns what it calls from a system message
            messages = [{"role": "system", "content": plan.system_prompt()}, *messages]
        text = self._chat_prompt(messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        req = self._new_request(text, self.llm.get_tokenizer().encode(text), body, max_tokens, "messages", guided)
        job = Job(self.worker, req, self.model_name, CHAT.id_prefix, http)
        if plan is not None:
            return await self._respond_tool_calls(job, plan, body)
        return await self._respond(job, CHAT, body, http)

    # helpers
    def _check(self, body: _RequestBody) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")
        body.check_supported()
        body.check_stop()

    def _guided(self, body: _RequestBody):
        """The body's output constraint and tool-call plan (minillm/guided/api.py); bad ones are 400s."""
        try:
            return guided_from_fields(body.response_format, body.guided_json, body.guided_regex,
                                      body.guided_choice, body.guided_grammar, body.tools, body.tool_choice)
        except ValueError as e:
            raise APIError(400, str(e)) from e

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
                     max_tokens: int | None, prompt_field: str, guided=None) -> Request:
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
                max_tokens=max_tokens, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos,
                guided_decoding=guided)
            (req,) = self.llm.make_requests([{"prompt": text, "prompt_token_ids": ids}], params)
        except ValueError as e:
            raise APIError(400, str(e).replace("SamplingParams.", "")) from e
        return req

    async def _respond(self, job: Job, shape: _Shape, body: _RequestBody, http: HTTPRequest):
        if body.stream:
            return StreamingResponse(_event_stream(job, shape, body.include_usage),
                                     media_type="text/event-stream")
        try:
            text = await job.text()
        except EngineFailure as e:
            raise _engine_error(e) from e
        return {**job.head(shape.object), "choices": [shape.choice(text, job.finish_reason)], "usage": job.usage()}

    async def _respond_tool_calls(self, job: Job, plan: ToolCallPlan, body: _RequestBody):
        if body.stream:
            return StreamingResponse(_tool_event_stream(job, plan, body.include_usage), media_type="text/event-stream")
        try:
            text = await job.text()
        except EngineFailure as e:
            raise _engine_error(e) from e
        if job.finish_reason != "stop":          # cut by max_tokens: the arguments are not whole JSON
            return {**job.head(CHAT.object), "choices": [CHAT.choice(text, job.finish_reason)], "usage": job.usage()}
        message = {"role": "assistant", "content": None, "tool_calls": plan.tool_calls(text)}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}
        return {**job.head(CHAT.object), "choices": [choice], "usage": job.usage()}


class _Guard:
    """ASGI middleware before the endpoints: the API key on /v1/*, then the body size limit.
    Plain ASGI, not @app.middleware, whose wrapper would stand between a stream and its client."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.authorization = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.authorization is not None and scope["path"].startswith("/v1/") and \
                not hmac.compare_digest(headers.get(b"authorization", b""), self.authorization):
            error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                             code="invalid_api_key")
            return await error.response()(scope, receive, send)
        # read the whole body here (at most the limit, whether Content-Length says or the chunks
        # do), so that no handler holds more; then hand the messages on unchanged
        too_big = APIError(413, f"the request body is larger than {self.max_body_bytes} bytes")
        if int(headers.get(b"content-length", 0)) > self.max_body_bytes:
            return await too_big.response()(scope, receive, send)
        messages, size = [], 0
        while not messages or messages[-1].get("more_body"):
            messages.append(await receive())
            if messages[-1]["type"] != "http.request":      # the client left
                break
            size += len(messages[-1].get("body", b""))
            if size > self.max_body_bytes:
                return await too_big.response()(scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def build_app(llm, served_model_name: str = "smollm2", api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, max_waiting: int = 256,
              stall_timeout_s: float = 60.0, engine_thread: bool = True) -> FastAPI:
    """The FastAPI app; its lifespan stops the engine's loop, and starts it on a thread of its own unless
    engine_thread is False (then the caller runs app.state.server.worker.run(), as serve() does). app.state.server
    is the OpenAIServer, for in-process access to its worker.

    api_key: /v1/* wants `Authorization: Bearer <api_key>` (None: open). max_waiting: requests
    with no output yet beyond which new ones get a 429. stall_timeout_s: /health answers 503
    when the engine thread has made no progress for this long although work is queued."""
    for name, value, allowed in (("max_waiting", max_waiting, "an integer >= 1"),
                                 ("max_body_bytes", max_body_bytes, "an integer >= 1"),
                                 ("stall_timeout_s", stall_timeout_s, "a number of seconds > 0")):
        integer = isinstance(value, int) and not isinstance(value, bool)
        if not ((integer or name == "stall_timeout_s" and isinstance(value, float)) and value > 0):
            raise ValueError(f"{name} = {value!r} is invalid; allowed: {allowed}")
    server = OpenAIServer(llm, served_model_name, max_waiting, stall_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if engine_thread:
            server.worker.start()
        yield
        server.worker.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    for kind in (APIError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(kind, _error_response)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    app.get("/debug/engine")(server.debug_engine)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    return app


def warm_up(llm) -> float:
    """Run the engine's step shapes once before the port opens, so that the first users do not wait for
    torch.compile: a prefill, a step of two decode rows (the compiled batched step) and one of a single row (the
    compiled decode step). The prefix cache is emptied afterwards. -> seconds taken."""
    t0 = time.perf_counter()
    prompt = list(range(1, 1 + min(24, llm.max_model_len - 8)))                 # any token ids will do
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[::-1]}], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def serve(llm, host: str = "127.0.0.1", port: int = 8000, served_model_name: str = "smollm2", **options) -> None:
    """Serve until Ctrl-C or SIGTERM (python -m minillm serve); options go to build_app. The engine is warmed
    (warm_up) before the port opens: a server that answers /health is ready at full speed. The engine then steps on
    this thread, the one that loaded and warmed it, and HTTP runs on another (why: minillm/engine/worker.py)."""
    print(f"warming up the engine (compiling its steps) before opening port {port} ...", file=sys.stderr, flush=True)
    print(f"warm-up took {warm_up(llm):.1f} s", file=sys.stderr, flush=True)
    app = build_app(llm, served_model_name, engine_thread=False, **options)
    worker = app.state.server.worker
    http = ServerThread(app, host, port, log_level="info", on_exit=worker.stop)

    def shut_down(_signum, _frame):               # first signal: drain open streams; second: cut them
        http.request_exit()

    handlers = {sig: signal.signal(sig, shut_down) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        worker.run()                              # until the HTTP side has shut down (its lifespan stops it)
    finally:
        http.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class ServerThread:
    """uvicorn serving the app from a background thread: serve()'s HTTP side, and a server inside a test, a
    benchmark or a notebook.

        with ServerThread(build_app(llm)) as server:     # port 0: the OS picks a free port
            openai.OpenAI(base_url=server.base_url, api_key="unused")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 on_exit=None):
        """on_exit: called on the HTTP thread when uvicorn has stopped, however it stopped."""
        import uvicorn

        self.app = app
        # on shutdown, open streams get 5 s to finish; then they are cut and their requests aborted
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._on_exit = on_exit
        self._thread = threading.Thread(target=self._serve, name="minillm-http", daemon=True)
        self.url = self.base_url = None

    def _serve(self) -> None:
        try:
            self._server.run()
        finally:
            if self._on_exit is not None:
                self._on_exit()

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

    def request_exit(self) -> None:
        """Ask uvicorn to stop (safe from a signal handler); asked twice, it cuts open connections."""
        if self._server.should_exit:
            self._server.force_exit = True
        self._server.should_exit = True

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""The OpenAI-compatible HTTP API (Starlette, run by uvicorn) over a BatchEngine.

    POST /v1/chat/completions   messages -> the model's chat template -> answer (stream or not)
    POST /v1/completions        prompt text as is (the tokenizer's BOS rule) -> continuation
    GET  /v1/models             the one served model;  GET /health: counters;  GET /: chat page

Request keys: model (the served name), messages | prompt, max_tokens, temperature (0 = greedy),
top_p, top_k, stop (a string or up to 4), seed, n (1 only), stream, stream_options.include_usage.
Errors are OpenAI's JSON object {"error": {"message", "type", "param", "code"}}: 400 for bad
input, 401 for a missing / wrong bearer key (when the server has one), 404 model_not_found,
413 for a body over the cap. A streaming client that disconnects cancels its row in the batch.
"""
import asyncio
import hmac
import json
import os
import time
import uuid

from ..data.chat_template import ChatTemplateError
from ..generation import GenerationConfig, decode_output
from ..text_generation import encode_prompt
from .detok import StreamText

STATIC = os.path.join(os.path.dirname(__file__), "static")
MAX_STOPS = 4
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
# OpenAI keys that change the answer and are not implemented: refused unless at their default
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
               "best_of": (None, 1), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
               "tools": (None, []), "suffix": (None, "")}


class APIError(Exception):
    def __init__(self, status, message, code=None, param=None, type_="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def response(self):
        from starlette.responses import JSONResponse

        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}}, self.status)


def _get(body, key, types, default=None, required=False):
    """body[key] checked against `types` (bool is not a number here)."""
    if key not in body or body[key] is None:
        if required:
            raise APIError(400, f"'{key}' is a required property", "missing_required_parameter", key)
        return default
    v = body[key]
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    ok = (isinstance(v, bool) if types == bool else number if types == float
          else isinstance(v, int) and not isinstance(v, bool) if types == int else isinstance(v, types))
    if not ok:
        name = {bool: "a boolean", float: "a number", int: "an integer"}.get(types, "of another type")
        raise APIError(400, f"'{key}' must be {name}, got {json.dumps(v)[:60]}", "invalid_type", key)
    return v


class Server:
    """Request parsing and the endpoints. `engine` is a started BatchEngine."""

    def __init__(self, engine, tokenizer, model_name, max_length, eos_ids, api_key=None,
                 max_request_bytes=1 << 20):
        self.engine, self.tok, self.name = engine, tokenizer, model_name
        self.max_length, self.eos, self.api_key = max_length, list(eos_ids), api_key
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())

    # ------------------------------------------------------------------ request checks
    def check_auth(self, request):
        if not self.api_key:
            return
        got = request.headers.get("authorization", "")
        if not got.startswith("Bearer ") or not hmac.compare_digest(got[7:].strip(), self.api_key):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                           "with the key the server was started with (--api_key)", "invalid_api_key")

    async def read_body(self, request):
        """The JSON object of the body; 413 past max_request_bytes (checked while reading)."""
        cap = self.max_request_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cap:
            raise APIError(413, f"request body of {declared} bytes is over the server's limit of "
                           f"{cap} bytes (--max_request_bytes)", "request_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > cap:
                raise APIError(413, f"request body is over the server's limit of {cap} bytes "
                               "(--max_request_bytes)", "request_too_large")
        try:
            body = json.loads(bytes(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})", "invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", "invalid_json")
        return body

    def check_model(self, body):
        model = _get(body, "model", str, required=True)
        if model != self.name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.name}' (GET /v1/models)", "model_not_found", "model")

    def chat_prompt(self, body):
        msgs = _get(body, "messages", list, required=True)
        if not msgs:
            raise APIError(400, "'messages' must hold at least one message", "invalid_value", "messages")
        clean = []
        for i, m in enumerate(msgs):
            if isinstance(m, dict) and isinstance(m.get("content"), list):   # text parts
                parts = m["content"]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in parts):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   "invalid_value", "messages")
                m = dict(m, content="".join(p["text"] for p in parts))
            if isinstance(m, dict):
                m = {k: m[k] for k in ("role", "content") if k in m}
            clean.append(m)
        if self.tok.template is None:
            raise APIError(400, "this model has no chat template: use /v1/completions, or restart "
                           "the server with --chat_template", "no_chat_template")
        try:
            return encode_prompt(self.tok, clean, True)
        except (ChatTemplateError, ValueError) as e:
            raise APIError(400, f"messages: {e}", "invalid_value", "messages") from None

    def completion_prompt(self, body):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if prompt is None:
            raise APIError(400, "'prompt' is a required property", "missing_required_parameter", "prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string (one prompt per request: n=1)",
                           "invalid_type", "prompt")
        ids = self.tok.encode(prompt)
        if not ids:
            raise APIError(400, "'prompt' is empty and the tokenizer adds no BOS: give some text",
                           "invalid_value", "prompt")
        return ids

    def generation_config(self, body, prompt_len, default_max):
        for key, defaults in UNSUPPORTED.items():
            if body.get(key, None) not in defaults:
                raise APIError(400, f"'{key}' is not supported by this server", "unsupported_parameter", key)
        n = _get(body, "n", int, 1)
        if n != 1:
            raise APIError(400, f"'n' must be 1 (one answer per request), got {n}", "invalid_value", "n")
        room = self.max_length - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this server's max_length is "
                           f"{self.max_length} (prompt + answer): shorten it", "context_length_exceeded",
                           "messages" if "messages" in body else "prompt")
        max_tokens = _get(body, "max_tokens", int, None)
        if max_tokens is None:
            max_tokens = _get(body, "max_completion_tokens", int, None)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"'max_tokens' must be >= 1, got {max_tokens}", "invalid_value", "max_tokens")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} + the prompt's {prompt_len} tokens is over "
                           f"this server's max_length {self.max_length}; ask for at most {room}",
                           "context_length_exceeded", "max_tokens")
        temperature = _get(body, "temperature", float, 1.0)
        top_p = _get(body, "top_p", float, 1.0)
        top_k = _get(body, "top_k", int, 0)
        seed = _get(body, "seed", int, None)
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOPS}",
                           "invalid_value", "stop")
        if not 0 <= temperature <= 2:
            raise APIError(400, f"'temperature' must be in [0, 2], got {temperature}", "invalid_value", "temperature")
        if not 0 < top_p <= 1:
            raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", "invalid_value", "top_p")
        if top_k < 0:
            raise APIError(400, f"'top_k' must be >= 0, got {top_k}", "invalid_value", "top_k")
        greedy = temperature == 0 or top_k == 1
        return GenerationConfig(max_new_tokens=max_tokens or min(default_max, room),
                                decode_strategy="greedy_search" if greedy else "sampling",
                                temperature=temperature or 1.0, top_p=top_p, top_k=top_k,
                                stop=stop, seed=seed).validate()

    # ------------------------------------------------------------------ endpoints
    async def completions(self, request, chat):
        try:
            self.check_auth(request)
            body = await self.read_body(request)
            self.check_model(body)
            prompt = self.chat_prompt(body) if chat else self.completion_prompt(body)
            # an answer without max_tokens: OpenAI's defaults (16 for completions, to the limit for chat)
            cfg = self.generation_config(body, len(prompt), self.max_length if chat else 16)
            stream = _get(body, "stream", bool, False)
            opts = _get(body, "stream_options", dict, {})
        except APIError as e:
            return e.response()
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        req = self.engine.submit(prompt, cfg, lambda t, r: loop.call_soon_threadsafe(events.put_nowait, (t, r)))
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": self.name, "object": "chat.completion" if chat else "text_completion"}
        if stream:
            from starlette.responses import StreamingResponse

            return StreamingResponse(self._stream(req, events, meta, chat, bool(opts.get("include_usage"))),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(request, req, events, meta, chat)

    def _usage(self, req):
        p, c = len(req.prompt), len(req.tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def _complete(self, request, req, events, meta, chat):
        from starlette.responses import JSONResponse

        try:
            while True:
                try:
                    t, reason = await asyncio.wait_for(events.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, 499)
                    continue
                if t is None:
                    return APIError(500, reason[6:], "generation_failed", type_="server_error").response()
                if reason is not None:
                    break
        finally:
            req.cancel()   # no-op when finished; stops the row when the client went away
        text = decode_output(self.tok, req.tokens, req.cfg.stop, self.eos)
        reason = FINISH[req.finish_reason]
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                   "logprobs": None} if chat else
                  {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
        return JSONResponse(dict(meta, choices=[choice], usage=self._usage(req)))

    def _chunk(self, meta, chat, text=None, reason=None, role=False):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}, "text_completion"
        return "data: " + json.dumps(dict(meta, object=obj, choices=[choice]), ensure_ascii=False) + "\n\n"

    async def _stream(self, req, events, meta, chat, include_usage):
        """SSE chunks: (chat: a role chunk) text pieces, a chunk with finish_reason, [usage], [DONE].
        Leaving early (the client disconnected: the send fails and this generator is closed)
        cancels the request, which leaves the batch at the engine's next step."""
        text = StreamText(self.tok, self.eos, req.cfg.stop)
        try:
            if chat:
                yield self._chunk(meta, chat, role=True)
            while True:
                t, reason = await events.get()
                if t is None:
                    err = {"message": reason[6:], "type": "server_error", "param": None, "code": "generation_failed"}
                    yield "data: " + json.dumps({"error": err}) + "\n\n"
                    break
                piece = text.push(t)
                if reason is not None:
                    piece += text.finish()
                if piece:
                    yield self._chunk(meta, chat, piece)
                if reason is not None:
                    yield self._chunk(meta, chat, reason=FINISH[reason])
                    if include_usage:
                        yield "data: " + json.dumps(dict(meta, object="chat.completion.chunk" if chat
                                                         else "text_completion", choices=[],
                                                         usage=self._usage(req))) + "\n\n"
                    yield "data: [DONE]\n\n"
                    break
        finally:
            req.cancel()

    async def models(self, request):
        from starlette.responses import JSONResponse

        try:
            self.check_auth(request)
        except APIError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model",
                                                         "created": self.created, "owned_by": "paddletune",
                                                         "max_model_len": self.max_length}]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse(dict(self.engine.stats, status="ok", queued=self.engine.queue.qsize()))

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import FileResponse
        from starlette.routing import Route

        async def not_found(request, exc):
            return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                            "not_found" if exc.status_code == 404 else "method_not_allowed").response()

        async def chat(request):
            return await self.completions(request, True)

        async def completion(request):
            return await self.completions(request, False)

        async def page(request):
            return FileResponse(os.path.join(STATIC, "index.html"), media_type="text/html; charset=utf-8")

        routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
                  Route("/v1/completions", completion, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/", page, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})

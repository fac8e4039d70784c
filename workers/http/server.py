"""The HTTP side both embedded roles share: SGLang's worker endpoints over an `Engine`.

The model is built after the socket is listening, so `/health` answers 503 while starting and 200
once serving, as SGLang's does. Role servers (prefill/decode) supply `events(spec)`: the request's
lifecycle as an async stream of engine events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from typing import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ... import __version__
from ...core import Role
from ...request_schema import error_text, json_body
from ..args import WorkerArgs
from ..engine.kernel_ops import KernelOps
from ..engine.loop import Engine
from ..engine.presets import model_config
from ..engine.request import Aborted, Event, Failed, LoopEmitter, Req, Reserved, Token
from ..engine.runner import ModelRunner, RunnerConfig
from ..engine.tokenizer import ByteTokenizer, ChatTemplateError
from .liveness import Liveness
from .metrics import WorkerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from .responses import GenSpec, ResponseBuilder, error_body, error_response, sse

log = logging.getLogger(__name__)
READY_LINE = "The server is fired up and ready to roll!"


class BadRequest(ValueError):
    """A request the worker refuses with 400 (the message says what to fix)."""


class WorkerServer:
    # The role a subclass serves; this base serves none of its own (it builds no engine).
    role: Role | None = None

    def __init__(self, args: WorkerArgs):
        self.args = args
        self.tokenizer = ByteTokenizer()
        self.engine: Engine | None = None
        self.liveness: Liveness | None = None
        self.metrics: WorkerMetrics | None = None
        self._startup: asyncio.Task | None = None
        self.exit_reason: str | None = None   # set when the engine died: the process exits non-zero

    # -- lifecycle ----------------------------------------------------------------------------
    def runner_config(self) -> RunnerConfig:
        a = self.args
        return RunnerConfig(model=model_config(a.model_preset, seed=a.seed), page_size=a.page_size,
                            max_total_tokens=a.max_total_tokens, context_length=a.context_length, device=a.device,
                            kernels=a.kernel_list, kv_dtype=a.kv_cache_dtype,
                            cuda_graph_max_bs=0 if a.disable_cuda_graph or a.role is Role.PREFILL else a.cuda_graph_max_bs)

    def build_engine(self, runner: ModelRunner) -> Engine:
        raise NotImplementedError

    def _build(self) -> None:
        torch.set_num_threads(1)
        runner = ModelRunner(self.runner_config())
        self.engine = self.build_engine(runner)
        self.engine.on_death = self._engine_died
        self.metrics = WorkerMetrics(self.engine, self.args.served_model_name, self.role, self.args.context_length)
        self.engine.start()

    def _engine_died(self, reason: str) -> None:
        """Called on the dead engine thread: stop serving and exit non-zero (serving.serve_all)."""
        log.critical("%s; this worker exits so that its supervisor restarts it", reason)
        self.exit_reason = reason
        os.kill(os.getpid(), signal.SIGTERM)

    @property
    def ready(self) -> bool:
        return self.liveness is not None and self.engine.alive

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        async def build():
            await asyncio.to_thread(self._build)
            self.liveness = Liveness(self.engine, self.args.stall_timeout_s)
            log.info("%s (%s on %s:%s)", READY_LINE, self.role, self.args.host, self.args.port)
        self._startup = asyncio.create_task(build())
        try:
            yield
        finally:
            if self.engine is not None:
                self.engine.stop()

    # -- requests -----------------------------------------------------------------------------
    def parse(self, kind: str, body: dict) -> GenSpec:
        model = {"chat": ChatCompletionRequest, "completion": CompletionRequest, "generate": GenerateRequest}[kind]
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            raise BadRequest("; ".join(_describe(e, model.SGLANG) for e in exc.errors())) from None
        a = self.args
        try:
            if kind == "chat":
                ids = req.input_ids or self.tokenizer.apply_chat_template(
                    [m.model_dump() for m in req.messages], continue_final=req.continue_final_message)
            elif kind == "completion":
                ids = req.prompt if isinstance(req.prompt, list) else self.tokenizer.encode(req.prompt)
            else:
                ids = req.input_ids if req.input_ids is not None else self.tokenizer.encode(req.text)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc)) from None
        if not ids or any(not 0 <= i < self.tokenizer.vocab_size for i in ids):
            sent = "prompt" if kind == "completion" else "input_ids" if req.input_ids is not None else \
                "messages" if kind == "chat" else "text"
            raise BadRequest(f"{sent}: the prompt must be a non-empty list of token ids in [0, "
                             f"{self.tokenizer.vocab_size})")
        if len(ids) >= a.context_length:
            raise BadRequest(f"the prompt has {len(ids)} tokens; this server's context_length is "
                             f"{a.context_length} (prompt + output); shorten the prompt")
        asked = req.max_asked()
        if asked is not None and len(ids) + asked > a.context_length:   # SGLang's check (its TokenizerManager)
            raise BadRequest(f"Requested token count exceeds the model's maximum context length of "
                             f"{a.context_length} tokens. You requested a total of {len(ids) + asked} tokens: "
                             f"{len(ids)} tokens from the input messages and {asked} tokens for the completion. "
                             "Please reduce the number of tokens in the input messages or the completion to fit "
                             "within the limit.")
        try:
            params = req.sampling(default_max=a.default_max_tokens)
        except ValueError as exc:   # SamplingParams names the field
            raise BadRequest(str(exc)) from None
        usage = kind != "generate" and bool(req.stream_options and req.stream_options.include_usage)
        token_ids = bool(getattr(req, {"chat": "stream_token_ids", "completion": "return_token_ids",
                                       "generate": "return_prompt_token_ids"}[kind]))
        return GenSpec(kind=kind, rid=req.rid or uuid.uuid4().hex, prompt_ids=ids, params=params, stream=req.stream,
                       include_usage=usage, model=a.served_model_name, room=req.bootstrap_room,
                       bootstrap_host=req.bootstrap_host, bootstrap_port=req.bootstrap_port,
                       logprob_text=kind != "generate" or bool(req.return_text_in_logprobs), token_ids=token_ids)

    def budget(self, spec: GenSpec) -> int:
        return min(len(spec.prompt_ids) + spec.params.max_new_tokens, self.args.context_length)

    async def submit(self, spec: GenSpec) -> tuple[Req, asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        req = Req(rid=spec.rid, prompt_ids=spec.prompt_ids, params=spec.params, budget=self.budget(spec),
                  emit=LoopEmitter(asyncio.get_running_loop(), queue), room=spec.room, bootstrap=spec.bootstrap_url)
        self.engine.submit(req)
        return req, queue

    async def events(self, spec: GenSpec) -> AsyncIterator[Event]:
        """The request's engine events until it finishes or fails; aborts it if the consumer leaves."""
        req, queue = await self.submit(spec)
        done = False
        try:
            while not done:
                try:
                    ev = await asyncio.wait_for(queue.get(), 1.0)
                except asyncio.TimeoutError:
                    stall = self.liveness.stalled()
                    if stall is None:
                        continue
                    self.engine.abort(req.rid, stall)   # runs when the engine comes round again
                    ev = Failed(503, f"{stall}; this request was ended so that it does not hang, retry it")
                if isinstance(ev, Reserved):
                    ev = await self.on_reserved(spec, req, ev)
                    if ev is None:
                        continue
                done = isinstance(ev, (Failed, Aborted)) or (isinstance(ev, Token) and ev.finish_reason is not None)
                yield ev
        finally:
            if not done:
                self.engine.abort(req.rid, "the client went away")

    async def on_reserved(self, spec: GenSpec, req: Req, ev: Reserved) -> Failed | None:
        """Role hook: decode tells the prefill where its KV goes; a Failed ends the request."""
        raise NotImplementedError(f"a {self.role} engine never reserves pages for a peer")

    async def generate(self, kind: str, request: Request) -> Response:
        if not self.ready:
            return error_response(503, "the server is still starting; retry when /health answers 200")
        try:
            body = json_body(await request.body())
        except ValueError as exc:
            return error_response(400, str(exc))
        try:
            spec = self.parse(kind, body)
            self.check(spec)
        except BadRequest as exc:
            return error_response(400, str(exc))
        except UnicodeError as exc:  # a lone surrogate escape ("\\ud800") is valid JSON but no UTF-8 text
            why = getattr(exc, "reason", "not encodable")
            return error_response(400, f"the prompt is not valid Unicode text ({why}); send UTF-8 text")
        except ValueError as exc:
            return error_response(400, str(exc))
        events = self.events(spec)
        if spec.stream:
            return StreamingResponse(self._stream(spec, events), media_type="text/event-stream")
        return await self._collect(spec, events, request)

    def check(self, spec: GenSpec) -> None:
        """Role hook: refuse requests this role cannot serve."""

    async def _collect(self, spec: GenSpec, events: AsyncIterator[Event], request: Request) -> Response:
        """The whole answer; a client that leaves first (its connection closed) aborts the request, as SGLang's
        server does for a non-streaming one: the engine frees its KV instead of decoding for nobody."""
        answer = asyncio.ensure_future(self._answer(spec, events))
        left = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait((answer, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            left_first = not answer.done()
            answer.cancel()   # unless done: closes `events`, which aborts the engine's request
        if left_first:
            with contextlib.suppress(asyncio.CancelledError):
                await answer
            return Response(status_code=499)   # nobody reads it
        return answer.result()

    async def _answer(self, spec: GenSpec, events: AsyncIterator[Event]) -> Response:
        out = ResponseBuilder(spec, self.tokenizer)
        started = last = time.monotonic()
        async with contextlib.aclosing(events):
            async for ev in events:
                if isinstance(ev, Failed):
                    return error_response(ev.status, ev.message)
                if isinstance(ev, Aborted):
                    out.abort(ev.message)
                    return JSONResponse(out.final("abort"))
                out.push(ev.token_id, ev.finish, ev.cached_tokens, ev.logprob)
                last = self._token_timed(len(out.ids), last)
                if ev.finish_reason:
                    self.metrics.e2e.observe(last - started)
                    return JSONResponse(out.final(ev.finish_reason, prefill_only=self.role is Role.PREFILL))
        return error_response(500, "the request ended without a result")

    def _token_timed(self, n: int, last: float) -> float:
        """Observe the `n`-th output token's latency (TTFT for the first, inter-token after, streamed or not, as
        SGLang's engine counts them); returns now."""
        now = time.monotonic()
        (self.metrics.ttft if n == 1 else self.metrics.itl).observe(now - last)
        return now

    async def _stream(self, spec: GenSpec, events: AsyncIterator[Event]):
        """One event per token, except while text is held back (`ResponseBuilder.holding`): as SGLang's scheduler
        streams nothing while the output's end may start a stop string, the held tokens come out with the event
        that releases their text. So every event ends where the text of the ids it carries is all out."""
        out = ResponseBuilder(spec, self.tokenizer)
        started = last = time.monotonic()
        sent, unsent = False, ""
        async with contextlib.aclosing(events):
            async for ev in events:
                if isinstance(ev, Failed):
                    yield sse(error_body(ev.status, ev.message))
                    break
                if isinstance(ev, Aborted):   # SGLang: a finished chunk with the text held back, then usage
                    yield sse(out.chunk(unsent + out.abort(ev.message), "abort", first=not sent))
                    usage = out.usage_chunk()
                    if usage:
                        yield sse(usage)
                    break
                unsent += out.push(ev.token_id, ev.finish, ev.cached_tokens, ev.logprob)
                now = last = self._token_timed(len(out.ids), last)
                if out.holding:
                    continue
                yield sse(out.chunk(unsent, ev.finish_reason, first=not sent, prefill_only=self.role is Role.PREFILL))
                sent, unsent = True, ""
                if ev.finish_reason:
                    self.metrics.e2e.observe(now - started)
                    usage = out.usage_chunk()
                    if usage:
                        yield sse(usage)
                    break
        yield sse("[DONE]")

    # -- app ----------------------------------------------------------------------------------
    def server_info(self) -> dict:
        a, e = self.args, self.engine
        pool = e.runner.pool
        return {
            "model_path": f"embedded:dsv4-{a.model_preset}", "served_model_name": a.served_model_name, "tp_size": 1,
            "dp_size": 1, "disaggregation_mode": self.role.value, "disaggregation_transfer_backend": a.transfer_backend,
            "disaggregation_bootstrap_port": a.disaggregation_bootstrap_port, "context_length": a.context_length,
            "page_size": a.page_size, "kv_cache_dtype": pool.layout.dtype, "device": a.device,
            "max_total_num_tokens": pool.capacity_tokens, "max_req_input_len": a.context_length - 1,
            "internal_states": [{"num_used_tokens": pool.used_tokens,
                                 "token_usage": pool.used_tokens / pool.capacity_tokens,
                                 "last_gen_throughput": e.stats.last_gen_throughput,
                                 "num_running_reqs": e.stats.num_running, "num_queue_reqs": e.stats.num_queued}],
            **self.kernel_info(), "engine": "embedded", "version": __version__,
        }

    def kernel_info(self) -> dict:
        """What ran, from the device-side call counters (`kernel_ops.py`), never from --kernels: `kernels`
        {name: impls that ran, most calls first | "off" | "not called yet"}, `kernel_calls` {name: {impl: n}},
        and how decode steps ran (CUDA-graph replays by captured size, eager steps)."""
        runner = self.engine.runner
        counts = runner.model.ops.counts()
        graphs = runner.graphs
        return {"kernels": KernelOps.summary(counts, self.args.kernel_list), "kernel_calls": counts,
                "model_preset": self.args.model_preset,
                "decode_steps": {"cuda_graph_replays": graphs.replays if graphs else 0,
                                 "cuda_graph_sizes": list(graphs.sizes) if graphs else [],
                                 "eager": runner.eager_steps}}

    def model_info(self) -> dict:
        return {"model_path": f"embedded:dsv4-{self.args.model_preset}", "served_model_name": self.args.served_model_name,
                "is_generation": True, "reasoning_parser": None, "tool_call_parser": None,
                "disaggregation_mode": self.role.value}



def _describe(error: dict, model: str) -> str:
    """One pydantic error as a sentence that names the field and what to do."""
    where = ".".join(map(str, error["loc"]))
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field (SGLang 0.5.23's {model} has no such field); remove it"
    message = error_text(error)
    return f"{where}: {message}" if where else message


async def _disconnect(request: Request) -> None:
    """Returns when the client's connection closed (the body was read already: what comes next is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

"""`LLM` (also `Engine`): load a model and run offline batches, with vLLM's API.

    llm = braid.LLM()                       # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], braid.SamplingParams(temperature=0.8, top_p=0.95))
    print(outs[0].outputs[0].text)

`LLM` runs the same processes as `braid serve` (scheduler and detokenizer, over ZMQ); its
`TokenizerManager` lives on an asyncio loop in a background thread of the caller's process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from braid.runtime.assets import ModelAssets
from braid.runtime.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from braid.runtime.config import EngineConfig
from braid.runtime.config_keywords import resolve_overrides
from braid.runtime.errors import ParamError
from braid.runtime.front_loop import SHUT_DOWN, FrontLoop, release
from braid.runtime.ipc.to_detokenizer import SpecUsage
from braid.runtime.ipc.to_scheduler import EmbedSpec, ImageInput
from braid.runtime.launch import spawn_runtime
from braid.runtime.models.config import BASE_MODEL_ARCHS
from braid.runtime.multimodal.frontend import MediaFrontend
from braid.runtime.offline_prompts import (
    Prompt,
    PromptInput,
    priorities,
    progress,
    prompt_list,
    read_prompt,
    truncated,
)
from braid.runtime.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    SampleOutputs,
    logprob_dict,
    spec_meta_info,
)
from braid.runtime.pooling import PoolingConfig, PoolingParams, floats, prompt_keep
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.tokenizer.chat import chat_prompt
from braid.runtime.tokenizer.manager import TokenizerManager
from braid.runtime.tokenizer.tokenizer import word_encoder

logger = logging.getLogger(__name__)

# Prompts with images that an offline batch loads, sends and runs at once: each holds its
# processed pixels (2.4 MB for a 448x448 image in bf16) until it finishes.
IMAGE_PROMPTS_IN_FLIGHT = 256


@dataclass
class _Sample:
    """The caller-side state of one sample while it runs: its outputs so far."""

    index: int
    rid: str
    outputs: SampleOutputs = field(default_factory=SampleOutputs)

    def output(self, with_logprobs: bool) -> CompletionOutput:
        o = self.outputs
        logprobs = cumulative = None
        if with_logprobs:
            logprobs = [logprob_dict(lp, o.token_texts) for lp in o.logprobs]
            cumulative = sum((lp.logprob for lp in o.logprobs), 0.0)
        return CompletionOutput(
            index=self.index,
            text=o.text,
            token_ids=list(o.token_ids),
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
        )


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    images: list[ImageInput] = field(default_factory=list)
    samples: list[_Sample] = field(default_factory=list)
    priority: int = 0

    @property
    def finished(self) -> bool:
        return all(s.outputs.finished for s in self.samples)

    def output(self) -> RequestOutput:
        outs = [s.outputs for s in self.samples]
        scored = next((o for o in outs if o.prompt_logprobs is not None), None)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[s.output(self.params.logprobs is not None) for s in self.samples],
            finished=self.finished,
            # The prompt's hit when it was submitted (later samples may hit what the first
            # computed).
            num_cached_tokens=outs[0].cached_tokens if outs else 0,
            prompt_logprobs=None
            if scored is None
            else [
                None if lp is None else logprob_dict(lp, scored.token_texts)
                for lp in scored.prompt_logprobs or []
            ],
            metrics=self.metrics(),
        )

    def metrics(self) -> dict[str, float]:
        """Speculative decoding's counts over the samples (SGLang's `meta_info` names)."""
        spec = [s.outputs.spec for s in self.samples if s.outputs.spec is not None]
        if not spec:
            return {}
        total = SpecUsage(
            sum(s.verify_steps for s in spec),
            sum(s.proposed_drafts for s in spec),
            sum(s.accepted_drafts for s in spec),
        )
        return spec_meta_info(total)


class LLM:
    """An offline engine over braid's runtime.

    `model`: None or "smollm2-135m" for the embedded model, a Hugging Face directory, a
    .gguf file, or a hub model id (`"Qwen/Qwen2.5-0.5B-Instruct"`, `"org/name@revision"`,
    `"org/name:Q4_K_M"`) fetched through the Hugging Face cache (`revision=`, `gguf_file=`;
    a model the cache lacks while the hub is out of reach is a `ValueError` saying how to get
    it). Every other keyword is an `EngineConfig` field by name (or SGLang's name for it:
    `max_total_tokens` is `kv_tokens`); an unknown one is a `ValueError` naming it and the
    close matches, raised before any process starts. Use as a context manager or call
    `shutdown()`.
    """

    def __init__(self, model: str | Path | None = None, **overrides: Any) -> None:
        t0 = time.perf_counter()
        given = overrides if model is None else {"model": str(model), **overrides}
        self.config = EngineConfig(**resolve_overrides(given))
        self.assets = ModelAssets.load(
            self.config.model,
            with_tokenizer=False,
            revision=self.config.revision,
            gguf_file=self.config.gguf_file,
        )
        self.model_path = self.assets.path
        self.model_config = self.assets.config
        self.model_config.check_engine(self.config)
        self.eos_token_ids = self.assets.eos_token_ids
        self._ids = itertools.count()
        self._closed = False
        # The front end's asyncio loop runs in a daemon thread; calls hop onto it.
        self._front = FrontLoop()
        self.tm = TokenizerManager(
            self.config, self.model_path, self.eos_token_ids, spawn=spawn_runtime
        )
        started = self._front.submit(self.tm.start())
        try:
            # The tokenizer loads here while the runtime processes start.
            self.assets.load_tokenizer()
            self.tokenizer = self.assets.tokenizer
            self.tm.encode_words = word_encoder(self.tokenizer)
            self.media = MediaFrontend(
                self.config, self.model_path, self.model_config, self.tokenizer, caller_files=True
            )
            self.ready = started.result()
        except BaseException:
            if not started.done():
                started.cancel()
                self._call(self.tm.shutdown())
            self._front.stop()
            raise
        # Collected unheld (`del llm`), its processes stop too; shutdown() runs the same.
        self._release = weakref.finalize(self, release, self._front, self.tm, self.media)
        # Not at the interpreter's exit: its thread pools are gone by then (the runtime's
        # processes end with their parent anyway).
        self._release.atexit = False
        self.context_length = self.ready.context_length
        self.pooling = PoolingConfig.from_model(
            self.model_path,
            self.model_config.hidden_size,
            self.model_config.raw,
            self.config.pooling,
        )
        self.load_time_s = time.perf_counter() - t0
        logger.info(
            "braid ready: %s on %s (%s) in %.2f s (scheduler: %s)",
            self.config.model or self.model_path.name,
            self.ready.device,
            self.ready.dtype,
            self.load_time_s,
            ", ".join(f"{k} {v:.2f} s" for k, v in self.ready.phases.items()),
        )

    def _call(self, coro):
        return self._front.call(coro)

    def run_coroutine(self, coro) -> concurrent.futures.Future:
        """Schedule `coro` on the engine's front-end loop (where `self.tm` lives), from any
        thread; the language's Engine backend drives requests this way."""
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        return self._front.submit(coro)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """braid's defaults, overridden by the model's generation_config.json unless
        `generation_config="braid"`."""
        return self.assets.default_sampling_params(self.config.generation_config)

    # ---- public API ---------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids", and for a vision-language model "multi_modal_data": {"image": one
        image or a list}, each a path, URL, bytes or PIL image, with one placeholder per image
        in the prompt: `llm.media.placeholder`); outputs come back in input order.
        `priority`: one per prompt, lower first (`schedule_policy="priority"` only)."""
        items = self._read_prompts(prompts)
        return self._run(items, self._params_for(sampling_params, len(items)), use_tqdm, priority)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_call_parser: str | None = "auto",
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (OpenAI message format),
        rendered with the tokenizer's chat template (or `chat_template`), given
        `chat_template_kwargs` as extra template variables (such as Qwen3's `enable_thinking`);
        `continue_final_message` leaves the last message open for the model to go on with (with
        `add_generation_prompt=False`).

        `tools` are OpenAI tool dicts. `tool_choice` is "auto" (the default with tools: calls
        are parsed from the text by `tool_call_parser`, which "auto" detects from the chat
        template and "none" turns off), "none", "required", or {"type": "function",
        "function": {"name": ...}}; the last two constrain decoding so that every call is well
        formed and its arguments match the tool's parameters (at most one call for "required"
        when `parallel_tool_calls` is false). With tools, each output's `tool_calls` lists the
        calls (`ToolCall`: id, name, JSON `arguments`; possibly empty) and `text` stays the
        model's raw text. `ValueError` names a bad field."""
        from braid.runtime.function_call import resolve_parser_name
        from braid.runtime.function_call.tools import ToolPlan

        tok = self._require_tokenizer()
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        plan = None
        if tools is not None or tool_choice is not None:
            parser = resolve_parser_name(tool_call_parser, chat_template or tok.chat_template)
            plan = ToolPlan.resolve(tools, tool_choice, parallel_tool_calls, parser=parser)
            if plan and plan.mode == "auto" and parser is None and tool_call_parser == "auto":
                raise ParamError.at(
                    "tool_choice",
                    '"auto" needs a tool-call parser and none was found for this chat template: '
                    "name tool_call_parser (or 'none' for the raw text), or use 'required' or "
                    "a named function",
                )
        conversations = messages if isinstance(messages[0], list) else [messages]
        placeholder = self.media.placeholder if self.media.supports_images else None
        items = []
        for c, conv in enumerate(conversations):
            prompt = chat_prompt(
                tok,
                conv,
                placeholder,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=plan.template_tools if plan is not None else None,
                template_kwargs=chat_template_kwargs,
                continue_final_message=continue_final_message,
                where="messages" if c == 0 else f"messages[{c}]",
            )
            items.append(Prompt(prompt.text, prompt.ids, prompt.sources))
        params = self._params_for(sampling_params, len(items))
        if plan is None:
            return self._run(items, params, use_tqdm)
        outputs = self._run(items, [plan.sampling_params(p) for p in params], use_tqdm)
        for out in outputs:
            for sample in out.outputs:
                sample.tool_calls = plan.parse(sample.text)[1]
        return outputs

    def embed(
        self,
        prompts: PromptInput | list[PromptInput],
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, token ids, or a dict with "prompt" or
        "prompt_token_ids"), in input order: the prompt's final hidden states pooled as the
        model's sentence-transformers config says, else by the `pooling` setting (last token
        by default). `normalize` (default: the model's config, else True) scales each vector
        to unit length; `dimensions` truncates it first (Matryoshka models only);
        `truncate_prompt_tokens=k` embeds each prompt's last k tokens (-1: as many as the
        context takes). `pooling_params` (vLLM's `PoolingParams`) may carry the same fields.
        The prompts run through the scheduler like prefills, batched with whatever else runs;
        nothing is sampled and no request holds KV after it. `ValueError` names a bad field."""
        given = PoolingParams.merge(
            pooling_params,
            normalize=normalize,
            dimensions=dimensions,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        spec = self.pooling.spec(given["normalize"], given["dimensions"])
        keep = prompt_keep(given["truncate_prompt_tokens"], self.context_length)
        items = self._read_prompts(prompts)
        params = SamplingParams(max_tokens=0)
        for i, item in enumerate(items):
            if item.sources:
                raise ValueError(f"prompt {i}: embeddings take text only")
            if keep is not None:
                items[i] = item = replace(item, ids=item.ids[-keep:])
            self.media.check_no_placeholders(item.ids, f"prompt {i}")
            self.tm.validate(item.ids, params, where=f"prompt {i}", embed=True)
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        ids = [item.ids for item in items]
        rids = [f"emb-{next(self._ids)}" for _ in ids]
        vectors = self._call(self._embed_async(rids, items, params, spec, use_tqdm))
        return [
            EmbeddingRequestOutput(rid, p, EmbeddingOutput(v))
            for rid, p, v in zip(rids, ids, vectors)
        ]

    async def _embed_async(
        self,
        rids: list[str],
        prompts: list[Prompt],
        params: SamplingParams,
        spec: EmbedSpec,
        use_tqdm: bool,
    ) -> list[list[float]]:
        bar = progress(use_tqdm, total=len(prompts), desc="Embedding")

        async def one(rid: str, sample: str) -> list[float]:
            last = None
            async for out in self.tm.stream(sample):
                last = out
            if last is None or last.embedding is None:
                error = (last.error if last else None) or f"{rid} ended without an embedding"
                if last is not None and last.refused is not None:
                    raise ParamError(last.refused.param, error)
                raise RuntimeError(error)
            bar.update(1)
            return floats(last.embedding)

        tasks, samples = [], []
        try:
            with self.tm.together() as samples:  # one message: admitted in one iteration
                for rid, p in zip(rids, prompts):
                    samples += self.tm.submit(
                        rid, p.ids, params, embed=spec, cache_salt=p.cache_salt
                    )
            tasks = [asyncio.create_task(one(r, s)) for r, s in zip(rids, samples)]
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # a failure (or interrupt) stops everything this call started
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for sample in samples:  # one whose task was cancelled before it read anything
                self.tm.cancel(sample)
            bar.close()

    def beam_search(
        self,
        prompts: PromptInput | list[PromptInput],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: the best `params.beam_width` continuations of each prompt, best
        first (`braid.runtime.beam_search.beam_search`)."""
        return beam_search(self, prompts, params, lora_request, use_tqdm, concurrency_limit)

    def stats(self) -> dict[str, float]:
        """Runtime counters since start: requests, prompt and cached tokens, cache hit rate,
        prefill tokens computed, steps, retractions, evicted tokens, and KV usage now."""
        return self._call(self.tm.control("stats"))

    def programs(self) -> list[dict[str, Any]]:
        """The programs in flight or holding session pins, most pinned tokens first: each
        one's id, requests in flight, calls received and served, last call position,
        attained service (tokens computed) and pinned tokens and sessions (`ProgramInfo`)."""
        return [asdict(p) for p in self._call(self.tm.stats_and_programs())[1]]

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only possible while nothing runs (returns False then)."""
        return bool(self._call(self.tm.control("flush_cache"))["flushed"])

    def start_profile(self, output_dir: str | None = None) -> None:
        """Start the torch profiler in the scheduler process (CPU and CUDA activity; each
        forward a named range: `braid.prefill`, `braid.decode`, `braid.decode.graph`,
        `braid.vision_tower`). Its files go to `output_dir`, else `$BRAID_TORCH_PROFILER_DIR`;
        `ValueError` if neither is given or a profile already runs."""
        self._call(self.tm.profile("start_profile", output_dir))

    def stop_profile(self) -> list[str]:
        """Stop the profile `start_profile` began and write it: a Chrome trace
        (`.trace.json.gz`, for Perfetto) and a table of totals (`.txt`); returns their paths.
        `ValueError` if no profile runs."""
        return self._call(self.tm.profile("stop_profile"))

    def check_invariants(self) -> None:
        """Run the scheduler's KV accounting check; raises `RuntimeError` if it fails."""
        self._call(self.tm.control("check_invariants"))

    def shutdown(self) -> None:
        """Stop the runtime's processes. The engine cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------
    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_path} has no tokenizer: pass token ids")
        return self.tokenizer

    def _read_prompts(self, prompts: Any) -> list[Prompt]:
        def encode(text: str) -> list[int]:
            return self._require_tokenizer().encode(text)

        return [read_prompt(p, i, encode, self.media) for i, p in enumerate(prompt_list(prompts))]

    def _params_for(
        self, sampling_params: SamplingParams | list[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(
                    f"sampling_params: got {len(sampling_params)} for {n} prompts (give one, "
                    "or one per prompt)"
                )
            if not all(isinstance(p, SamplingParams) for p in sampling_params):
                raise ValueError("sampling_params: every item must be a SamplingParams")
            return list(sampling_params)
        raise ValueError(
            "sampling_params must be SamplingParams or a list of them, "
            f"got {type(sampling_params).__name__}"
        )

    def _run(
        self,
        items: list[Prompt],
        params: list[SamplingParams],
        use_tqdm: bool,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        ranks = priorities(priority, len(items), self.config.schedule_policy)
        if self._closed:
            raise RuntimeError(SHUT_DOWN)
        if self.model_config.architecture in BASE_MODEL_ARCHS:
            raise ValueError(
                f"model: {self.model_config.architecture} has no LM head; it serves embeddings "
                "only (LLM.embed)"
            )
        params = [self.tm.resolve(p) for p in params]  # bad words tokenized once
        items = [
            truncated(item, p, i, self.context_length)
            for i, (item, p) in enumerate(zip(items, params))
        ]
        for i, (item, p) in enumerate(zip(items, params)):
            if item.sources:  # ids are checked once expanded
                self.media.check_count(len(item.sources), f"prompt {i}")
            else:
                self.media.check_no_placeholders(item.ids, f"prompt {i}")
                self.tm.validate(item.ids, p, where=f"prompt {i}")
        requests = [
            _Request(f"req-{next(self._ids)}", item.text, item.ids, p, item.cache_salt, priority=r)
            for item, p, r in zip(items, params, ranks)
        ]
        sources = [item.sources for item in items]
        return self._call(self._run_async(requests, sources, use_tqdm))

    async def _run_async(
        self, requests: list[_Request], sources: list[list[Any]], use_tqdm: bool
    ) -> list[RequestOutput]:
        bar = progress(use_tqdm, total=len(requests), desc="Generating")
        # Requests with images hold their pixels until they finish: a bounded number at once.
        with_images = asyncio.Semaphore(IMAGE_PROMPTS_IN_FLIGHT)
        tasks = []
        try:
            # Prompts without images reach the scheduler as one message (admitted in one
            # iteration, so they are batched alike however busy the machine is).
            with self.tm.together() as sent:
                for req, found in zip(requests, sources):
                    if not found:
                        sent += self._submit(req)
            tasks = [
                asyncio.create_task(self._run_one(req, found, f"prompt {i}", bar, with_images))
                for i, (req, found) in enumerate(zip(requests, sources))
            ]
            await asyncio.gather(*tasks)
        finally:
            # An error (a bad image found late) or interrupt: stop everything this call started.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in requests:  # a sample whose task was cancelled before it read anything
                for sample in r.samples:
                    self.tm.cancel(sample.rid)
            bar.close()
        errors = [s.outputs.error for r in requests for s in r.samples if s.outputs.error]
        if errors and self.tm.failure:
            raise RuntimeError(self.tm.failure)
        for i, r in enumerate(requests):  # what the scheduler refused (a grammar it cannot compile)
            for s in r.samples:
                if s.outputs.refused is not None:
                    raise ParamError(s.outputs.refused.param, f"prompt {i}: {s.outputs.error}")
        return [r.output() for r in requests]

    async def _run_one(
        self, req: _Request, sources: list[Any], where: str, bar, with_images: asyncio.Semaphore
    ) -> None:
        """Submit one request and collect its samples. A request with images is submitted
        once they are processed (in the media workers), so earlier requests already run
        while later images load; at most `IMAGE_PROMPTS_IN_FLIGHT` of them are processed or
        running at once."""
        if not sources:  # submitted already
            await self._collect_all(req, bar)
            return
        async with with_images:
            req.prompt_ids, req.images = await self.media.prepare(req.prompt_ids, sources, where)
            self.tm.validate(req.prompt_ids, req.params, where=where)
            self._submit(req)
            await self._collect_all(req, bar)
            req.images = []  # the pixels are the scheduler's now

    def _submit(self, req: _Request) -> list[str]:
        rids = self.tm.submit(
            req.request_id, req.prompt_ids, req.params, images=req.images,
            cache_salt=req.cache_salt, priority=req.priority,
        )  # fmt: skip
        req.samples = [_Sample(k, rid) for k, rid in enumerate(rids)]
        return rids

    async def _collect_all(self, req: _Request, bar) -> None:
        await asyncio.gather(*(self._collect(req, s, bar) for s in req.samples))

    async def _collect(self, req: _Request, sample: _Sample, bar) -> None:
        async for out in self.tm.stream(sample.rid):
            sample.outputs.add(out)
        if req.finished:
            bar.update(1)


Engine = LLM

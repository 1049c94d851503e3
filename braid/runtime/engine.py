"""`LLM` (also `Engine`): load a model and run offline batches, with vLLM's API.

llm = braid.LLM()                       # the embedded SmolLM2-135M-Instruct
outs = llm.generate(["Hello"], braid.SamplingParams(temperature=0.8, top_p=0.95))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from braid.runtime.config import EngineConfig
from braid.runtime.executor.model_runner import ModelRunner
from braid.runtime.executor.sampler import fold_seed
from braid.runtime.ipc.to_detokenizer import TokenLogprob, TokenOut
from braid.runtime.ipc.to_scheduler import AbortReq, GenerateReq
from braid.runtime.models.config import ModelConfig
from braid.runtime.models.source import resolve_model
from braid.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from braid.runtime.sampling_params import SamplingParams, defaults_from_generation_config
from braid.runtime.scheduler.scheduler import Scheduler
from braid.runtime.tokenizer.detokenizer import IncrementalDetokenizer
from braid.runtime.tokenizer.tokenizer import load_tokenizer, render_chat

logger = logging.getLogger(__name__)

DEFAULT_MAX_PREFILL_TOKENS = {"cuda": 16384, "cpu": 8192}

PromptInput = str | list[int] | dict[str, Any]


@dataclass
class _Sample:
    """The caller-side state of one sample while it runs."""

    index: int
    rid: str
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.text if self.detok else "",
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[s.output() for s in self.samples],
            finished=self.finished,
            num_cached_tokens=self.cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


class LLM:
    """An offline engine over braid's runtime.

    `model`: None or "smollm2-135m" for the embedded model, a Hugging Face directory, or a
    .gguf file. Other arguments are `EngineConfig` fields. Use as a context manager or call
    `shutdown()`.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        kv_tokens: int | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        seed: int = 0,
        generation_config: str = "auto",
        page_size: int = 1,
        max_prefill_tokens: int | None = None,
        chunked_prefill_size: int | None = None,
        schedule_policy: str = "lpm",
        disable_radix_cache: bool = False,
        mem_fraction_static: float | None = None,
        device: str | None = None,
        attention_backend: str | None = None,
        load_format: str = "auto",
        show_progress: bool = True,
    ) -> None:
        t0 = time.perf_counter()
        self.config = EngineConfig(
            model=None if model is None else str(model),
            dtype=dtype,
            device=device,
            kv_tokens=kv_tokens,
            mem_fraction_static=mem_fraction_static,
            page_size=page_size,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            schedule_policy=schedule_policy,
            disable_radix_cache=disable_radix_cache,
            context_length=context_length,
            seed=seed,
            generation_config=generation_config,
            attention_backend=attention_backend,
            load_format=load_format,
            show_progress=show_progress,
        )
        self.model_path = resolve_model(model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        has_tokenizer = any(
            (self.model_path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")
        )
        self.tokenizer = load_tokenizer(self.model_path) if has_tokenizer else None
        gen_path = self.model_path / "generation_config.json"
        self.generation_config = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.runner = ModelRunner(
            self.config,
            self.model_config,
            None if load_format == "dummy" else self.model_path,
        )
        device_type = self.runner.device.type
        self.scheduler = Scheduler(
            self.runner,
            eos_token_ids=self._eos_ids(),
            max_prefill_tokens=max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS[device_type],
            chunked_prefill_size=self.config.effective_chunked_prefill_size,
            schedule_policy=schedule_policy,
            disable_radix_cache=disable_radix_cache,
        )
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._closed = False
        self.load_time_s = time.perf_counter() - t0
        logger.info("braid ready: %s in %.2f s", self.model_path.name, self.load_time_s)

    # ---- set-up helpers -----------------------------------------------------------------
    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (
            self.generation_config.get("eos_token_id"),
            self.model_config.raw.get("eos_token_id"),
        ):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list):
                ids.update(i for i in src if isinstance(i, int))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """braid's defaults, overridden by the model's generation_config.json unless
        `generation_config="braid"`."""
        if self.config.generation_config == "braid":
            return SamplingParams()
        return SamplingParams(**defaults_from_generation_config(self.generation_config))

    # ---- public API ---------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids"); outputs come back in input order."""
        items = [self._tokenize(p, i) for i, p in enumerate(self._as_prompt_list(prompts))]
        return self._run(items, self._params_for(sampling_params, len(items)), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (OpenAI message format),
        rendered with the tokenizer's chat template (or `chat_template`)."""
        tok = self._require_tokenizer()
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        items = []
        for conv in conversations:
            text = render_chat(
                tok,
                conv,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
            )
            ids = tok.encode(text, add_special_tokens=False)
            if not ids:
                raise ValueError("messages: the rendered conversation is empty")
            items.append((text, ids))
        return self._run(items, self._params_for(sampling_params, len(items)), use_tqdm)

    def stats(self) -> dict[str, float]:
        """Runtime counters since start: requests, prompt and cached tokens, cache hit rate,
        prefill tokens computed, steps, retractions, evicted tokens."""
        return self.scheduler.stats.as_dict()

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only possible while nothing runs (returns False then)."""
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        """Free the model and KV memory. The engine cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.abort_all()
        del self.scheduler, self.runner

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------
    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_path} has no tokenizer: pass token ids")
        return self.tokenizer

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("prompts: the list is empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
                return [list(prompts)]
            return list(prompts)
        raise ValueError(
            f"prompts must be a string, token ids, or a list of them, got {type(prompts).__name__}"
        )

    def _tokenize(self, prompt: PromptInput, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt {i}: a dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {i}: the prompt is empty")
            return prompt, self._require_tokenizer().encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError(f"prompt {i}: the prompt is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError(f"prompt {i}: token ids must be integers")
            return None, list(prompt)
        raise ValueError(f"prompt {i}: expected a string or token ids, got {type(prompt).__name__}")

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

    def _check(self, i: int, ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        ctx = self.runner.context_length
        if len(ids) >= ctx:
            raise ValueError(
                f"prompt {i}: {len(ids)} tokens is longer than the context length allows "
                f"({ctx} tokens in all, at least one of them generated)"
            )
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary ({vocab})")
        params.check_token_ids(vocab)

    def _seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return fold_seed(self._rng.getrandbits(64))
        if index == 0:
            return fold_seed(params.seed)
        digest = hashlib.sha256(f"{params.seed}/{index}".encode()).digest()
        return fold_seed(int.from_bytes(digest[:8], "little"))

    def _new_request(self, prompt, ids, params) -> _Request:
        rid = f"req-{next(self._ids)}"
        samples = []
        for k in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                )
            samples.append(_Sample(index=k, rid=f"{rid}/{k}", detok=detok))
            if params.logprobs is not None:
                samples[-1].logprobs = []
                samples[-1].cumulative_logprob = 0.0
        return _Request(rid, prompt, ids, params, samples)

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        for i, ((_, ids), p) in enumerate(zip(items, params)):
            self._check(i, ids, p)
        requests = [self._new_request(text, ids, p) for (text, ids), p in zip(items, params)]
        by_rid: dict[str, tuple[_Request, _Sample]] = {}
        try:
            for req in requests:
                for s in req.samples:
                    self.scheduler.handle(
                        GenerateReq(
                            s.rid, req.prompt_ids, req.params, self._seed(req.params, s.index)
                        )
                    )
                    by_rid[s.rid] = (req, s)
            with tqdm(
                total=len(requests), desc="Generating", unit="req", disable=not use_tqdm
            ) as bar:
                while self.scheduler.has_work:
                    for out in self.scheduler.step():
                        req, sample = by_rid[out.rid]
                        was_done = req.finished
                        self._apply(req, sample, out)
                        if req.finished and not was_done:
                            bar.update(1)
        finally:
            # Whatever happened (an error, an interrupt), nothing of this call stays running.
            for rid, (_, sample) in by_rid.items():
                if sample.finish_reason is None:
                    self.scheduler.handle(AbortReq(rid))
                    sample.finish_reason = "abort"
        return [r.output() for r in requests]

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _logprob_dict(self, lp: TokenLogprob) -> dict[int, Logprob]:
        d = {lp.token_id: Logprob(lp.logprob, lp.rank, self._decode_one(lp.token_id))}
        for rank, (tid, val) in enumerate(lp.top, start=1):
            if tid not in d:
                d[tid] = Logprob(val, rank, self._decode_one(tid))
        return d

    def _apply(self, req: _Request, sample: _Sample, out: TokenOut) -> None:
        if sample.finish_reason is not None:
            return  # e.g. tokens computed before a stop string's abort arrived
        req.cached_tokens = out.cached_tokens
        sample.token_ids += out.new_token_ids
        if out.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = [
                None if lp is None else self._logprob_dict(lp) for lp in out.prompt_logprobs
            ]
        if out.logprobs and sample.logprobs is not None:
            for lp in out.logprobs:
                sample.logprobs.append(self._logprob_dict(lp))
                sample.cumulative_logprob += lp.logprob
        if sample.detok is not None:
            sample.detok.add_tokens(out.new_token_ids)
            if sample.detok.stopped:
                sample.finish_reason, sample.stop_reason = "stop", sample.detok.stop_reason
                if out.finish_reason is None:
                    self.scheduler.handle(AbortReq(sample.rid))
                return
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_token


Engine = LLM

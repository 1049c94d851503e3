"""The in-process backend: braid's own runtime (`braid.Engine` / `braid.LLM`), reached through
its TokenizerManager and so over ZMQ to the scheduler, with program sessions.

A prompt's images are loaded and processed by the engine's `MediaFrontend` (in its worker
threads), which widens each image placeholder to the image's tokens; every request made for
the prompt (a gen's samples, each `select` option) carries the same processed images, so the
runtime's prefix cache shares the image's KV between them."""

from __future__ import annotations

import asyncio
import itertools
import queue
import time
import uuid
from typing import Any

from braid.lang.backends.base import (
    Backend,
    ChoiceScores,
    GenOutput,
    OnDelta,
    Prompt,
    choice_span,
    logprob_entry,
    runtime_sampling,
    unconditional_tokens,
)
from braid.lang.images import for_runtime
from braid.lang.ir import SamplingArgs
from braid.runtime.errors import ParamError
from braid.runtime.ipc.to_detokenizer import TokenLogprob
from braid.runtime.ipc.to_scheduler import ImageInput
from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.outputs import SampleOutputs, finish_reason_info
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.tokenizer.roles import RoleTemplate, role_template

_DONE = object()


class SampleMeta:
    """One sample's SGLang-shaped meta info, kept up to date as its outputs arrive (`add`;
    they gather in `outputs`)."""

    def __init__(self, rid: str, sampling: SamplingArgs, prompt_ids: list[int]) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.logprobs = bool(sampling.return_logprob)
        self.top = sampling.top_logprobs_num or 0
        start = sampling.logprob_start_len
        self.input_start = start if self.logprobs and start is not None and start >= 0 else None
        self.t0 = time.perf_counter()
        self.outputs = SampleOutputs()
        self._entered = 0  # output logprobs already in the meta
        self.meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": None,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
        }
        if self.logprobs:
            self.meta["output_token_logprobs"] = []
            if self.top:
                self.meta["output_top_logprobs"] = []

    @property
    def text(self) -> str:
        return self.outputs.text

    def _entries(self, lp: TokenLogprob, texts: dict[int, str]) -> tuple[list, list]:
        chosen = logprob_entry(lp.logprob, lp.token_id, texts.get(lp.token_id, ""))
        top = [logprob_entry(v, t, texts.get(t, "")) for t, v in lp.top[: self.top]]
        return chosen, top

    def add(self, out: StrOut) -> None:
        """Add `out`, the sample's next output, and bring the meta up to date."""
        o, m = self.outputs, self.meta
        o.add(out)
        m["prompt_tokens"] = o.prompt_tokens
        m["completion_tokens"] = o.completion_tokens
        m["cached_tokens"] = o.cached_tokens
        texts = o.token_texts
        if self.logprobs:
            for lp in o.logprobs[self._entered :]:
                chosen, top = self._entries(lp, texts)
                m["output_token_logprobs"].append(chosen)
                if self.top:
                    m["output_top_logprobs"].append(top)
            self._entered = len(o.logprobs)
        if self.input_start is not None and out.prompt_logprobs is not None:
            inputs, tops = [], []
            for pos in range(self.input_start, len(self.prompt_ids)):
                lp = out.prompt_logprobs[pos]
                tid = self.prompt_ids[pos]
                if lp is None:
                    inputs.append(logprob_entry(None, tid, texts.get(tid, "")))
                    tops.append(None)
                else:
                    chosen, top = self._entries(lp, texts)
                    inputs.append(chosen)
                    tops.append(top)
            m["input_token_logprobs"] = inputs
            if self.top:
                m["input_top_logprobs"] = tops
        if o.finished:
            m["finish_reason"] = finish_reason_info(
                o.finish_reason, o.stop_reason, o.completion_tokens, o.error
            )
            m["e2e_latency"] = time.perf_counter() - self.t0


class EngineBackend(Backend):
    """Runs programs on an `LLM`. `owns`: shut the engine down with the backend (True when
    the backend started it from a model path)."""

    def __init__(self, llm, owns: bool = False) -> None:
        self.llm = llm
        self.owns = owns
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._roles = role_template(llm.tokenizer)

    @property
    def precache_key(self) -> object:
        return ("engine", id(self.llm))

    @property
    def role_template(self) -> RoleTemplate:
        return self._roles

    @property
    def supports_images(self) -> bool:
        return self.llm.media.supports_images

    @property
    def image_placeholder(self) -> str:
        if not self.llm.media.supports_images:
            raise ValueError(
                f"image(): model {self.llm.model_path.name} takes text only; images need a "
                "vision-language model"
            )
        return self.llm.media.placeholder

    # ---- helpers ------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        if self.llm.tokenizer is None:
            raise ValueError(f"model {self.llm.model_path} has no tokenizer: programs need one")
        ids = self.llm.tokenizer.encode(text)
        if not ids:
            raise ValueError("the program's prompt is empty: append text before gen/select")
        return ids

    def _params(self, fields: dict[str, Any]) -> SamplingParams:
        return self.llm.get_default_sampling_params().replace(**fields)

    def _rid(self) -> str:
        return f"prog-{self._prefix}-{next(self._ids)}"

    def _with_images(self, ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """`ids` with each image placeholder widened to its image's tokens, and the images
        processed (`ValueError` naming the image that cannot be loaded)."""
        if not images:
            self.llm.media.check_no_placeholders(ids, "prompt")
            return ids, []
        sources = [for_runtime(x) for x in images]
        return self.llm.run_coroutine(self.llm.media.prepare(ids, sources, "image()")).result()

    def _widen(
        self,
        full: list[int],
        text_ids: list[int],
        prompt_ids: list[int],
        images: list[ImageInput],
        sources: list[Any],
    ) -> tuple[list[int], list[ImageInput]]:
        """A select option's ids and images. `full` is the prompt text and the option
        tokenized together; `prompt_ids` is the prompt's `text_ids` widened for `images`.
        Where the option leaves the prompt's tokens as they are up to its last image (always,
        but for a tokenizer that merges text into an image placeholder), the option reuses
        the prompt's widened tokens and processed images, so they are processed once for all
        options; otherwise it is processed by itself from `sources`."""
        shared = choice_span(text_ids, full)
        grown = len(prompt_ids) - len(text_ids)
        if images[-1].offset + images[-1].num_tokens - grown <= shared:
            return prompt_ids[: shared + grown] + full[shared:], images
        return self._with_images(full, sources)

    def _submit(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        session: str | None,
        position: int | None,
        images: list[ImageInput],
        program: str | None = None,
    ) -> list[str]:
        """Submit one request (on the engine's loop); with a session or a program, the call's
        position goes with it."""
        return self.llm.tm.submit(
            rid,
            ids,
            params,
            session_id=session,
            images=images,
            program_id=program,
            program_position=position if session is not None or program is not None else None,
        )

    def _stream(
        self,
        ids: list[int],
        params: SamplingParams,
        session: str | None,
        position: int | None,
        rid: str,
        images: list[ImageInput],
        program: str | None = None,
    ):
        """(sample index, StrOut) of one request's samples as they arrive, as a blocking
        iterator usable from any thread."""
        self.llm.tm.validate(ids, params)
        q: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                rids = self._submit(rid, ids, params, session, position, images, program)

                async def one(k: int, rid: str) -> None:
                    async for out in self.llm.tm.stream(rid):
                        q.put((k, out))

                await asyncio.gather(*(one(k, r) for k, r in enumerate(rids)))
            except BaseException as e:  # delivered to the waiting thread, which raises it
                q.put(e)
            finally:
                q.put(_DONE)

        self.llm.run_coroutine(pump())
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _run_all(
        self,
        jobs: list[
            tuple[list[int], SamplingParams, str | None, int | None, list[ImageInput], str | None]
        ],
    ) -> list[SampleOutputs]:
        """Several requests (ids, params, session, position, images, program) submitted
        together (so the scheduler batches them); the outputs of each one's (first) sample."""

        async def one(ids, params, session, position, images, program) -> SampleOutputs:
            rids = self._submit(self._rid(), ids, params, session, position, images, program)
            outputs = SampleOutputs()
            async for out in self.llm.tm.stream(rids[0]):
                outputs.add(out)
            return outputs

        async def all_() -> list[SampleOutputs]:
            return await asyncio.gather(*(one(*j) for j in jobs))

        for ids, params, *_ in jobs:
            self.llm.tm.validate(ids, params)
        return self.llm.run_coroutine(all_()).result()

    # ---- Backend ------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingArgs,
        constraint: tuple[str, Any] | None = None,
        on_delta: OnDelta | None = None,
    ) -> GenOutput:
        fields = runtime_sampling(sampling)
        if constraint is not None:
            fields[constraint[0]] = constraint[1]
        params = self._params(fields)
        ids, images = self._with_images(self._encode(prompt.text), prompt.images)
        rid = self._rid()
        # The ids TokenizerManager.submit gives the samples.
        names = [f"{rid}/{k}" for k in range(params.n)] if params.n > 1 else [rid]
        samples = [SampleMeta(name, sampling, ids) for name in names]
        for k, out in self._stream(
            ids, params, prompt.session, prompt.position, rid, images, prompt.program
        ):
            sample = samples[k]
            sample.add(out)
            if out.finish_reason is not None and out.error:
                if out.refused is not None:  # the request's own fault: a ValueError
                    raise ParamError(out.refused.param, f"gen refused: {out.error}")
                raise RuntimeError(f"generation failed: {out.error}")
            if on_delta is not None and k == 0 and (out.text or out.finish_reason):
                on_delta(out.text, dict(sample.meta))
        texts = [s.text for s in samples] if params.n > 1 else None
        return GenOutput(samples[0].text, samples[0].meta, texts)

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceScores:
        text_ids = self._encode(prompt.text)
        prompt_ids, images = self._with_images(text_ids, prompt.images)
        jobs, spans, fulls = [], [], []
        scoring = {"max_tokens": 0, "temperature": 0.0, "prompt_logprobs": 0}
        for c in choices:
            # A choice spelling an image placeholder would stand for an image it does not have.
            self.llm.media.check_no_placeholders(self._encode(c), f"select choice {c!r}")
            full, full_images = self._encode(prompt.text + c), images
            if images:
                full, full_images = self._widen(full, text_ids, prompt_ids, images, prompt.images)
            start = max(1, choice_span(prompt_ids, full))
            spans.append(start)
            fulls.append(full)
            params = self._params({**scoring, "logprob_start_len": start})
            jobs.append(
                (full, params, prompt.session, prompt.position, full_images, prompt.program)
            )
        if unconditional:
            for c in choices:
                ids = self._encode(c)
                fulls.append(ids)
                spans.append(0)
                jobs.append((ids, self._params(scoring), None, None, [], None))
        results = self._run_all(jobs)
        scored = []
        cached = 0
        for outs, ids, start in zip(results, fulls, spans):
            if outs.error:
                if outs.refused is not None:
                    raise ParamError(outs.refused.param, f"select refused: {outs.error}")
                raise RuntimeError(f"select failed: {outs.error}")
            lps = outs.prompt_logprobs
            if lps is None:
                raise RuntimeError("select: the runtime returned no prompt log-probabilities")
            texts = outs.token_texts
            cached += outs.cached_tokens
            scored.append(
                [
                    logprob_entry(None if lp is None else lp.logprob, t, texts.get(t, ""))
                    for lp, t in zip(lps[start:], ids[start:])
                ]
            )
        tokens = scored[: len(choices)]
        unc = None
        if unconditional:
            unc = [
                unconditional_tokens(alone, len(toks))
                for alone, toks in zip(scored[len(choices) :], tokens)
            ]
        meta = {"prompt_tokens": len(prompt_ids), "cached_tokens": cached}
        return ChoiceScores(tokens, unc, meta)

    def cache_prefix(self, text: str, images: list[Any] | None = None) -> None:
        ids, processed = self._with_images(self._encode(text), images or [])
        params = self._params({"max_tokens": 0, "temperature": 0.0})
        for _ in self._stream(ids, params, None, None, self._rid(), processed):
            pass

    def end_program(self, program: str) -> None:
        if self.llm.tm.failure:
            return
        self.llm.run_coroutine(self.llm.tm.control("end_program", arg=program)).result()

    def close_session(self, session: str) -> None:
        if self.llm.tm.failure:
            return
        self.llm.run_coroutine(self.llm.tm.control("close_session", arg=session)).result()

    def get_model_name(self) -> str:
        return str(self.llm.model_path)

    def flush_cache(self) -> bool:
        return self.llm.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.get_model_name(),
            "stats": self.llm.stats(),
            "programs": self.llm.programs(),
        }

    def shutdown(self) -> None:
        if self.owns:
            self.llm.shutdown()

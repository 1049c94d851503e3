"""The in-process backend: braid's own runtime (`braid.Engine` / `braid.LLM`), reached through
its TokenizerManager and so over ZMQ to the scheduler, with program sessions."""

from __future__ import annotations

import asyncio
import itertools
import queue
import uuid
from typing import Any

from braid.lang.backends.base import (
    Backend,
    ChoiceScores,
    GenOutput,
    OnDelta,
    Prompt,
    choice_span,
    runtime_sampling,
    unconditional_scores,
)
from braid.lang.ir import SamplingArgs
from braid.runtime.ipc.to_tokenizer import StrOut
from braid.runtime.sampling_params import SamplingParams
from braid.runtime.tokenizer.roles import RoleTemplate, role_template

_DONE = object()


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
    def role_template(self) -> RoleTemplate:
        return self._roles

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

    def _stream(self, ids: list[int], params: SamplingParams, session: str | None):
        """StrOut messages of one request, as a blocking iterator usable from any thread."""
        self.llm.tm.validate(ids, params)
        rid = f"prog-{self._prefix}-{next(self._ids)}"
        q: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                self.llm.tm.submit(rid, ids, params, session_id=session)
                async for out in self.llm.tm.stream(rid):
                    q.put(out)
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

    def _run_all(self, jobs: list[tuple[list[int], SamplingParams, str | None]]) -> list[list]:
        """Several requests submitted together (so the scheduler batches them); their StrOuts."""

        async def one(ids, params, session) -> list[StrOut]:
            rid = f"prog-{self._prefix}-{next(self._ids)}"
            self.llm.tm.submit(rid, ids, params, session_id=session)
            return [out async for out in self.llm.tm.stream(rid)]

        async def all_() -> list[list[StrOut]]:
            return await asyncio.gather(*(one(*j) for j in jobs))

        for ids, params, _ in jobs:
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
        if prompt.images:
            raise ValueError(
                f"image(): model {self.llm.model_path.name} takes text only; images need a "
                "multimodal model"
            )
        fields = runtime_sampling(sampling)
        if constraint is not None:
            fields[constraint[0]] = constraint[1]
        params = self._params(fields)
        meta: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        if sampling.return_logprob:
            meta["output_token_logprobs"] = []
        text = ""
        for out in self._stream(self._encode(prompt.text), params, prompt.session):
            text += out.text
            meta["prompt_tokens"] = out.prompt_tokens
            meta["completion_tokens"] = out.completion_tokens
            meta["cached_tokens"] = out.cached_tokens
            if out.logprobs and "output_token_logprobs" in meta:
                texts = out.token_texts or {}
                meta["output_token_logprobs"] += [
                    (lp.logprob, lp.token_id, texts.get(lp.token_id, "")) for lp in out.logprobs
                ]
            if out.finish_reason is not None:
                meta["finish_reason"] = out.finish_reason
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
            if on_delta is not None and (out.text or out.finish_reason):
                on_delta(out.text, dict(meta))
        return GenOutput(text, meta)

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceScores:
        prompt_ids = self._encode(prompt.text)
        jobs, spans = [], []
        for c in choices:
            full = self._encode(prompt.text + c)
            start = max(1, choice_span(prompt_ids, full))
            spans.append(start)
            params = self._params(
                {
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "prompt_logprobs": 0,
                    "logprob_start_len": start,
                }
            )
            jobs.append((full, params, prompt.session))
        if unconditional:
            for c in choices:
                ids = self._encode(c)
                jobs.append(
                    (
                        ids,
                        self._params({"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}),
                        None,
                    )
                )
        results = self._run_all(jobs)
        scored = []
        cached = 0
        for outs in results:
            lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
            if lps is None:
                raise RuntimeError("select: the runtime returned no prompt log-probabilities")
            if outs[-1].error:
                raise RuntimeError(f"select failed: {outs[-1].error}")
            cached += outs[-1].cached_tokens
            scored.append(lps)
        cond = [[lp.logprob for lp in s[start:]] for s, start in zip(scored, spans)]
        unc = None
        if unconditional:
            unc = [
                unconditional_scores([lp.logprob for lp in s[1:]], len(c_lps))
                for s, c_lps in zip(scored[len(choices) :], cond)
            ]
        meta = {"prompt_tokens": len(prompt_ids), "cached_tokens": cached}
        return ChoiceScores(cond, unc, meta)

    def cache_prefix(self, text: str) -> None:
        ids = self._encode(text)
        for _ in self._stream(ids, self._params({"max_tokens": 1, "temperature": 0.0}), None):
            pass

    def close_session(self, session: str) -> None:
        if self.llm.tm.failure:
            return
        self.llm.run_coroutine(self.llm.tm.control("close_session", arg=session)).result()

    def shutdown(self) -> None:
        if self.owns:
            self.llm.shutdown()

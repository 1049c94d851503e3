"""`RuntimeEndpoint`: programs run on a `braid serve` (or SGLang-compatible) server over HTTP,
through its native `/generate` API, with program sessions and batched `select` scoring."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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
from braid.runtime.tokenizer.roles import RoleTemplate


class RuntimeEndpoint(Backend):
    """A running `braid serve` at `base_url`. Raises `ValueError` at construction if nothing
    answers there."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        try:
            self.info = self._request("GET", "/get_model_info", timeout=10)
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(
                f"RuntimeEndpoint: no braid server answers at {base_url} ({e})"
            ) from None
        tpl = self.info.get("role_template")
        self._roles = RoleTemplate.from_dict(tpl) if tpl else RoleTemplate.plain()

    @property
    def role_template(self) -> RoleTemplate:
        return self._roles

    # ---- HTTP ---------------------------------------------------------------------------
    def _open(self, method: str, path: str, body: Any = None, timeout: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            if 400 <= e.code < 500:
                raise ValueError(f"{self.base_url}{path}: {detail}") from None
            raise RuntimeError(f"{self.base_url}{path}: HTTP {e.code}: {detail}") from None

    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None):
        with self._open(method, path, body, timeout) as resp:
            return json.loads(resp.read())

    # ---- Backend ------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingArgs,
        constraint: tuple[str, Any] | None = None,
        on_delta: OnDelta | None = None,
    ) -> GenOutput:
        if prompt.images:
            raise ValueError("image(): this server's model takes text only")
        params = runtime_sampling(sampling)
        if constraint is not None:
            params[constraint[0]] = constraint[1]
        body = {
            "text": prompt.text,
            "sampling_params": params,
            "stream": True,
            "return_logprob": bool(sampling.return_logprob),
            "session_id": prompt.session,
        }
        text, meta = "", {}
        with self._open("POST", "/generate", body) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                piece = event["text"][len(text) :]
                text = event["text"]
                meta = self._meta(event["meta_info"])
                if on_delta is not None and piece:
                    on_delta(piece, dict(meta))
        finish = meta.get("finish_reason_detail") or {}
        if finish.get("type") == "abort" and finish.get("message"):
            raise RuntimeError(f"generation failed: {finish['message']}")
        return GenOutput(text, meta)

    @staticmethod
    def _meta(m: dict[str, Any]) -> dict[str, Any]:
        fr = m.get("finish_reason")
        out = {
            "prompt_tokens": m.get("prompt_tokens", 0),
            "completion_tokens": m.get("completion_tokens", 0),
            "cached_tokens": m.get("cached_tokens", 0),
            "finish_reason": fr.get("type") if isinstance(fr, dict) else fr,
            "finish_reason_detail": fr,
        }
        if "output_token_logprobs" in m:
            out["output_token_logprobs"] = [tuple(x) for x in m["output_token_logprobs"]]
        return out

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceScores:
        prompt_ids = self._tokenize(prompt.text)
        fulls = [self._tokenize(prompt.text + c) for c in choices]
        spans = [max(1, choice_span(prompt_ids, f)) for f in fulls]
        jobs = [(fulls, spans, prompt.session)]
        if unconditional:
            alone = [self._tokenize(c) for c in choices]
            jobs.append((alone, [1] * len(alone), None))
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda j: self._score(*j), jobs))
        cond = results[0]
        unc = None
        if unconditional:
            unc = [unconditional_scores(u, len(c)) for u, c in zip(results[1], cond)]
        return ChoiceScores(cond, unc, {"prompt_tokens": len(prompt_ids)})

    def _tokenize(self, text: str) -> list[int]:
        return self._request("POST", "/tokenize", {"prompt": text})["tokens"]

    def _score(
        self, ids: list[list[int]], spans: list[int], session: str | None
    ) -> list[list[float]]:
        """Log-probabilities of `ids[i][spans[i]:]`, all in one /generate batch."""
        first = min(spans)
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": first,
            "session_id": session,
        }
        outs = self._request("POST", "/generate", body)
        scores = []
        for o, span in zip(outs, spans):
            lps = o["meta_info"]["input_token_logprobs"][span - first :]
            scores.append([x[0] for x in lps])
        return scores

    def cache_prefix(self, text: str) -> None:
        self._request(
            "POST",
            "/generate",
            {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        )

    def close_session(self, session: str) -> None:
        self._request("POST", "/close_session", {"session_id": session})

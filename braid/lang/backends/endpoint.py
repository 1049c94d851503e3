"""`RuntimeEndpoint`: programs run on a `braid serve` (or SGLang-compatible) server over HTTP,
through its native `/generate` API, with program sessions and batched `select` scoring; and
`Runtime`, which starts that server as a subprocess (SGLang's `sgl.Runtime`).

A prompt's images go as `/generate`'s `image_data`, one per image placeholder of the text (the
server's `image_placeholder` from `/get_model_info`): a file, bytes or a PIL image as base64,
a URL as it is."""

from __future__ import annotations

import json
import tempfile
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
    unconditional_tokens,
)
from braid.lang.images import to_base64
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
        self._placeholder: str | None = self.info.get("image_placeholder")
        # Program sessions need one server; behind a router (`braid serve --dp-size`, which
        # routes no /close_session) they are dropped after the first close finds no route.
        self.sessions = True
        # Likewise /end_program (a router's workers forget an ended program when it idles).
        self.program_ends = True

    @property
    def precache_key(self) -> object:
        return ("endpoint", self.base_url)

    @property
    def role_template(self) -> RoleTemplate:
        return self._roles

    @property
    def supports_images(self) -> bool:
        return self._placeholder is not None

    @property
    def image_placeholder(self) -> str:
        if self._placeholder is None:
            raise ValueError(
                f"image(): the model of {self.base_url} ({self.info.get('model_path')}) takes "
                "text only; images need a vision-language model"
            )
        return self._placeholder

    @property
    def model_info(self) -> dict[str, Any]:
        """The server's /get_model_info answer (SGLang's attribute name)."""
        return self.info

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
                raise ValueError(f"{self.base_url}{path}: {detail or f'HTTP {e.code}'}") from None
            raise RuntimeError(f"{self.base_url}{path}: HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:  # refused, unknown host: the server is not there
            raise ConnectionError(f"cannot reach {self.base_url}{path}: {e.reason}") from None

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
        params = runtime_sampling(sampling)
        for name in ("logprobs", "prompt_logprobs", "logprob_start_len"):
            params.pop(name, None)  # /generate takes them as top-level fields
        if "seed" in params:  # SGLang's name, which SGLang's router (--dp-size) passes on
            params["sampling_seed"] = params.pop("seed")
        if constraint is not None:
            params[constraint[0]] = constraint[1]
        body: dict[str, Any] = {
            "text": prompt.text,
            "sampling_params": params,
            "return_logprob": bool(sampling.return_logprob),
            "top_logprobs_num": sampling.top_logprobs_num or 0,
            **self._program_fields(prompt.session, prompt.position, prompt.program),
        }
        if prompt.images:
            body["image_data"] = [to_base64(x) for x in prompt.images]
        if sampling.logprob_start_len is not None:
            body["logprob_start_len"] = sampling.logprob_start_len
        if params.get("n", 1) > 1:
            results = self._request("POST", "/generate", body)
            for r in results:
                self._raise_failure(r["meta_info"])
            texts = [r["text"] for r in results]
            return GenOutput(texts[0], results[0]["meta_info"], texts)
        body["stream"] = True
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
                meta = event["meta_info"]
                if on_delta is not None and piece:
                    on_delta(piece, dict(meta))
        self._raise_failure(meta)
        return GenOutput(text, meta)

    @staticmethod
    def _raise_failure(meta: dict[str, Any]) -> None:
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort" and finish.get("message"):
            raise RuntimeError(f"generation failed: {finish['message']}")

    def score_choices(
        self, prompt: Prompt, choices: list[str], unconditional: bool
    ) -> ChoiceScores:
        prompt_ids = self._tokenize(prompt.text)
        fulls = [self._tokenize(prompt.text + c) for c in choices]
        spans = [max(1, choice_span(prompt_ids, f)) for f in fulls]
        image_data = [to_base64(x) for x in prompt.images]
        prompt_tokens = len(prompt_ids)
        if image_data:
            # The server widens each image to its tokens, so the options' positions move by
            # what the prompt grows; computing the prompt first says by how much (and caches
            # it with its images for the options).
            prompt_tokens = self._prefill(prompt.text, image_data)
            spans = [s + prompt_tokens - len(prompt_ids) for s in spans]
        jobs = [(fulls, spans, prompt.session, prompt.position, image_data, prompt.program)]
        if unconditional:
            alone = [self._tokenize(c) for c in choices]
            jobs.append((alone, [0] * len(alone), None, None, [], None))
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda j: self._score(*j), jobs))
        tokens = results[0]
        unc = None
        if unconditional:
            unc = [unconditional_tokens(u, len(c)) for u, c in zip(results[1], tokens)]
        return ChoiceScores(tokens, unc, {"prompt_tokens": prompt_tokens})

    def _tokenize(self, text: str) -> list[int]:
        return self._request("POST", "/tokenize", {"prompt": text})["tokens"]

    def _program_fields(
        self, session: str | None, position: int | None, program: str | None
    ) -> dict[str, Any]:
        """A /generate body's program fields: the program run (so the server's program
        policies see one program, sessions or not), the session while sessions are on, and
        with either the call's position in the program."""
        body: dict[str, Any] = {"session_id": session if self.sessions else None}
        if program is not None:
            body["program_id"] = program
        if body["session_id"] is not None or program is not None:
            body["session_position"] = position
        return body

    def _score(
        self,
        ids: list[list[int]],
        spans: list[int],
        session: str | None,
        position: int | None,
        image_data: list[str],
        program: str | None,
    ) -> list[list[list[Any]]]:
        """`[logprob, token_id, text]` of `ids[i][spans[i]:]`, all in one /generate batch;
        every prompt with the images `image_data` (spans count their tokens widened)."""
        first = min(spans)
        body: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": first,
            **self._program_fields(session, position, program),
        }
        if image_data:
            body["image_data"] = [image_data] * len(ids)
        outs = self._request("POST", "/generate", body)
        return [
            list(o["meta_info"]["input_token_logprobs"][span - first :])
            for o, span in zip(outs, spans)
        ]

    def cache_prefix(self, text: str, images: list[Any] | None = None) -> None:
        self._prefill(text, [to_base64(x) for x in images or []])

    def _prefill(self, text: str, image_data: list[str]) -> int:
        """Compute `text`'s KV (with its images); how many tokens the server made of it."""
        body: dict[str, Any] = {
            "text": text,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        }
        if image_data:
            body["image_data"] = image_data
        return self._request("POST", "/generate", body)["meta_info"]["prompt_tokens"]

    def close_session(self, session: str) -> None:
        if not self.sessions:
            if "." not in session:  # a run's root session names its program
                self.end_program(session)
            return
        if not self._post_routed("/close_session", {"session_id": session}):
            self.sessions = False  # a router: its workers let the pin expire (session_ttl_s)

    def end_program(self, program: str) -> None:
        if self.program_ends and not self._post_routed("/end_program", {"program_id": program}):
            self.program_ends = False

    def _post_routed(self, path: str, body: dict[str, Any]) -> bool:
        """POST `body` to `path`; False where the server (a router) has no such route."""
        try:
            self._request("POST", path, body)
        except ValueError as e:
            if "404" not in str(e) and "Not Found" not in str(e):
                raise
            return False
        return True

    def get_model_name(self) -> str:
        return self.info["model_path"]

    def flush_cache(self) -> bool:
        try:
            with self._open("POST", "/flush_cache") as resp:
                return resp.status == 200  # a router's 206: some workers did not flush
        except ValueError:  # 400: requests are running
            return False

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")


class Runtime:
    """SGLang's `sgl.Runtime`: starts `braid serve` as a subprocess on a free port and talks to
    it through `self.endpoint` (a `RuntimeEndpoint`); `set_default_backend(runtime)` runs
    programs there. Keywords are `braid serve` flags by their Python names
    (`max_total_tokens=8192` is `--max-total-tokens 8192`; True is a bare flag); `model_path`
    is the model (None: the embedded one). The server's log goes to a file of its own
    (`log()` reads it), so `log_level` only sets how much it holds: "debug" or "info" (the
    start-up waits for the server's ready line, logged at info). Stop it with `shutdown()` or
    a `with` block."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        log_level: str = "info",
        launch_timeout: float = 300.0,
        **server_args: Any,
    ) -> None:
        from braid.runtime.server.launcher import start_server

        if log_level.lower() not in ("debug", "info"):
            raise ValueError(
                f"Runtime: log_level must be 'debug' or 'info' (got {log_level!r}): the server "
                "logs to a file, and start-up waits for its ready line"
            )
        args: list[str] = ["--log-level", log_level.lower()]
        if model_path is not None:
            args += ["--model", str(model_path)]
        kv_tokens = server_args.pop("max_total_tokens", 8192)
        for key, value in server_args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value not in (False, None):
                args += [flag, str(value)]
        self._log_dir = tempfile.TemporaryDirectory(prefix="braid-runtime-")
        self._server = start_server(
            self._log_dir.name, *args, kv_tokens=kv_tokens, timeout=launch_timeout
        )
        self.url = self._server.url
        self.generate_url = self.url + "/generate"
        self.endpoint = RuntimeEndpoint(self.url)

    def log(self) -> str:
        """What the server has logged so far."""
        return self._server.log()

    def shutdown(self) -> None:
        self._server.stop()
        self._log_dir.cleanup()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def get_tokenizer(self):
        from braid.utils import get_tokenizer

        return get_tokenizer(self.endpoint.get_model_name())

    def generate(
        self,
        prompt: str | list[str],
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
    ) -> str:
        """One /generate call; the JSON answer as a string (as SGLang's Runtime returns it)."""
        body: dict[str, Any] = {
            "text": prompt,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
            "top_logprobs_num": top_logprobs_num or 0,
        }
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        return json.dumps(self.endpoint._request("POST", "/generate", body))

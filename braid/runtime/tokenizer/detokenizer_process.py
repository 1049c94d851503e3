"""The detokenizer process: token ids in, text deltas out.

Keeps one `IncrementalDetokenizer` per running request, applies stop strings on the text (and
tells the scheduler to stop a request that hit one), holds back a tail that could still become
a stop string, decodes the tokens named in logprobs, and forwards every other message from the
scheduler to the tokenizer manager unchanged.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import zmq

from braid._logging import configure_logging
from braid.runtime.ipc.children import die_with_parent, parent_alive
from braid.runtime.ipc.sockets import Addresses, send
from braid.runtime.ipc.to_detokenizer import BatchTokenOut, TokenOut
from braid.runtime.ipc.to_scheduler import AbortReq
from braid.runtime.ipc.to_tokenizer import BatchStrOut, StrOut
from braid.runtime.tokenizer.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass
class _State:
    detok: IncrementalDetokenizer | None
    sent: int = 0  # characters of detok.text already sent
    completion_tokens: int = 0


class DetokenizerManager:
    """Socket-free logic: `process(batch)` returns the text outputs and the rids to abort."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}

    def process(self, batch: BatchTokenOut) -> tuple[BatchStrOut, list[str]]:
        outs, aborts = [], []
        for out in batch.outputs:
            st = self.states.get(out.rid)
            if st is None:
                if out.detok is None:
                    if out.error:  # refused before it ever ran
                        outs.append(self._str_out(out, "", None, out.finish_reason, None, 0))
                    continue  # late tokens of a request that already stopped
                spec = out.detok
                detok = None
                if self.tokenizer is not None:
                    detok = IncrementalDetokenizer(
                        self.tokenizer,
                        spec.prompt_tail,
                        skip_special_tokens=spec.skip_special_tokens,
                        stop=tuple(spec.stop),
                        include_stop_str_in_output=spec.include_stop_str_in_output,
                        min_tokens=spec.min_tokens,
                        stop_regex=tuple(spec.stop_regex),
                    )
                st = self.states[out.rid] = _State(detok)
            st.completion_tokens += len(out.new_token_ids)
            finish, stop_reason = out.finish_reason, out.stop_token
            text = ""
            if st.detok is not None:
                ids = out.new_token_ids
                if finish == "stop" and ids and not st.detok.include_stop:
                    # The scheduler stopped on an EOS or a stop token: its text is left out, as
                    # a stop string's is (vLLM's and SGLang's outputs); its id stays.
                    ids = ids[:-1]
                st.detok.add_tokens(ids)
                if st.detok.stopped and finish != "abort":
                    if finish is None:
                        aborts.append(out.rid)
                    finish, stop_reason = "stop", st.detok.stop_reason
                elif finish is not None and finish != "abort":
                    st.detok.finish()
                end = len(st.detok.text) if finish else st.detok.stream_safe_len()
                text = st.detok.text[st.sent : end]
                st.sent = max(st.sent, end)
            outs.append(self._str_out(out, text, st, finish, stop_reason, st.completion_tokens))
            if finish:
                del self.states[out.rid]
        return BatchStrOut(outs), aborts

    def _str_out(self, out: TokenOut, text, st, finish, stop_reason, completion) -> StrOut:
        texts = None
        if self.tokenizer is not None and (out.logprobs or out.prompt_logprobs):
            ids = set()
            for lp in (out.logprobs or []) + [x for x in out.prompt_logprobs or [] if x]:
                ids.add(lp.token_id)
                ids.update(t for t, _ in lp.top)
            texts = {i: self.tokenizer.decode([i]) for i in ids}
        return StrOut(
            rid=out.rid,
            text=text,
            token_ids=out.new_token_ids,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=completion,
            cached_tokens=out.cached_tokens,
            finish_reason=finish,
            stop_reason=stop_reason,
            error=out.error,
            refused=out.refused,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            token_texts=texts,
            spec=out.spec,
            embedding=out.embedding,
        )


def run_detokenizer_process(
    model_path: str, addrs: Addresses, parent_pid: int, log_level: str
) -> None:
    # The server stops this process; a signal to the whole group (a terminal's Ctrl-C, a
    # SIGTERM to the group) must not print a traceback or look like a crash. It holds nothing
    # that needs flushing, so SIGTERM ends it at once, with status 0.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    die_with_parent(parent_pid)
    configure_logging(log_level)
    from braid.runtime.ipc import codec
    from braid.runtime.tokenizer.tokenizer import has_tokenizer, load_decoder

    tokenizer = load_decoder(model_path) if has_tokenizer(Path(model_path)) else None
    manager = DetokenizerManager(tokenizer)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(addrs.detokenizer)
    to_tm = ctx.socket(zmq.PUSH)
    to_tm.connect(addrs.tokenizer)
    to_sched = ctx.socket(zmq.PUSH)
    to_sched.connect(addrs.scheduler)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        if not poller.poll(500):
            if not parent_alive(parent_pid):
                break
            continue
        try:
            msg = codec.decode(inbox.recv_multipart())
        except Exception as e:  # never crash on input
            logger.error("dropping a malformed message: %s", e)
            continue
        if isinstance(msg, BatchTokenOut):
            batch, aborts = manager.process(msg)
            for rid in aborts:
                send(to_sched, AbortReq(rid))
            if batch.outputs:
                send(to_tm, batch)
        else:
            send(to_tm, msg)

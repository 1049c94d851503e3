"""SGLang's opened sessions: `POST /open_session` gives a session id, and a `/generate` request
whose `session_params` name that session may continue one of the session's earlier requests
instead of sending the whole conversation again.

A request of an opened session is a node of the session's tree. With `session_params.rid` it
continues that request: its prompt is the earlier request's prompt and output, then its own
tokens (a leading BOS dropped); `drop_previous_output` leaves the earlier output out, `offset`
cuts the earlier sequence there first (Python's slice: negative counts from its end), and
`replace` makes it the earlier request's only continuation (the other continuations, and their
own, are forgotten and aborted if still running; without `rid`, every request of the session
is). A request may only continue one that has ended, unless it replaces it (the earlier one is
aborted, and its output so far is what is continued). Without `rid` a request starts a new
root with its own prompt. This is what SGLang's session controller does, kept here in the
front end: the scheduler receives whole prompts, and the session's pins (the session id, as
for any braid session) keep their KV cached between the calls.

A session id not opened here is a plain braid session (pins only): `rid`, `offset`, `replace`
and `drop_previous_output` need an opened one. Each node keeps its prompt's and (once it
has ended) its output's token ids; a session's tree is forgotten at `/close_session`, and at
most MAX_OPEN_SESSIONS are open at once.
"""

from __future__ import annotations

import threading
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from braid.runtime.server.guard import APIError

if TYPE_CHECKING:
    from braid.runtime.server.outputs import Choice
    from braid.runtime.server.protocol_native import SessionParams


# Sessions open at once: each holds its requests' token ids until /close_session.
MAX_OPEN_SESSIONS = 4096


@dataclass
class _Node:
    prompt: array  # token ids, 4 bytes each (a Python list of ints takes about 36)
    parent: str | None
    choice: Choice | None  # the sample's output as it arrives, until it has ended
    output: array | None = None  # its output's token ids once it has ended
    children: list[str] = field(default_factory=list)

    def finished(self) -> bool:
        """Whether its output says it ended (a request whose client left may have ended
        without its output saying so)."""
        return self.choice is None or self.choice.finish_reason is not None

    def sequence(self, drop_output: bool, ended: bool) -> list[int]:
        if ended and self.choice is not None:  # keep the ids only, not the whole output
            self.output, self.choice = array("i", self.choice.token_ids), None
        if drop_output:
            return self.prompt.tolist()
        out = self.output.tolist() if self.output is not None else list(self.choice.token_ids)
        return self.prompt.tolist() + out


@dataclass
class Continuation:
    """What `SessionTrees.prompt_for` decided for one request: its prompt, and the earlier
    requests its `replace` ends (aborted by the caller once the request is accepted)."""

    session_id: str
    rid: str
    prompt: list[int]
    parent: str | None
    replace: bool
    ends: list[str]


class SessionTrees:
    """The opened sessions and their requests' trees (thread-safe: requests are prepared on
    worker threads)."""

    def __init__(self) -> None:
        self._sessions: dict[str, dict[str, _Node]] = {}
        self._lock = threading.Lock()

    def open(self, session_id: str | None) -> str | None:
        """Open a session named `session_id` (None: a new id); its id, or None if a session of
        that id is open already."""
        with self._lock:
            if len(self._sessions) >= MAX_OPEN_SESSIONS:
                raise APIError(
                    400,
                    f"{MAX_OPEN_SESSIONS} sessions are open: close one (/close_session) first",
                    "session_id",
                )
            sid = session_id if session_id is not None else uuid.uuid4().hex
            if sid in self._sessions:
                return None
            self._sessions[sid] = {}
            return sid

    def close(self, session_id: str) -> bool:
        """Forget an opened session's tree; whether it was open."""
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def is_open(self, session_id: str | None) -> bool:
        return session_id is not None and session_id in self._sessions

    def prompt_for(
        self,
        params: SessionParams,
        rid: str,
        ids: list[int],
        bos: int | None,
        running: Callable[[str], bool],
    ) -> Continuation:
        """The prompt of request `rid` (tokens `ids`) in the opened session `params.id`, as
        `session_params` asks (`running`: whether a request is still in flight); `APIError`
        400 naming the field for a request it cannot be: an unknown `rid`, one still running
        (without `replace`), a rid already used in the session."""
        with self._lock:
            nodes = self._sessions.get(params.id)
            if nodes is None:  # closed since the caller looked
                raise APIError(400, f"session {params.id!r} is not open", "session_params.id")

            def in_flight(r: str) -> bool:
                # By the request's own output first: a rid names this session's request only
                # until it ends (a later request elsewhere may take the same rid).
                return not nodes[r].finished() and running(r)

            if rid in nodes:
                raise APIError(
                    400, f"rid {rid!r} is already a request of session {params.id!r}", "rid"
                )
            parent = params.rid
            if parent is None:
                if params.offset or params.drop_previous_output:
                    raise APIError(
                        400,
                        "session_params.offset and drop_previous_output continue a request: "
                        "give session_params.rid",
                        "session_params.rid",
                    )
                ends = [r for r in nodes if in_flight(r)] if params.replace else []
                return Continuation(params.id, rid, list(ids), None, bool(params.replace), ends)
            node = nodes.get(parent)
            if node is None:
                raise APIError(
                    400,
                    f"session_params.rid: no request {parent!r} in session {params.id!r}",
                    "session_params.rid",
                )
            ended = not in_flight(parent)
            if not ended and not params.replace:
                raise APIError(
                    400,
                    f"session_params.rid: request {parent!r} has not ended; continue it once "
                    "it has, or give replace: true",
                    "session_params.rid",
                )
            base = node.sequence(bool(params.drop_previous_output), ended)
            if params.offset:
                base = base[: params.offset]
            own = ids[1:] if bos is not None and ids[:1] == [bos] else ids
            ends = [parent] if params.replace and not ended else []
            if params.replace:
                ends += [r for r in _descendants(nodes, parent) if in_flight(r)]
            return Continuation(params.id, rid, base + own, parent, bool(params.replace), ends)

    def add(self, c: Continuation, choice: Choice) -> list[str]:
        """Enter a request now submitted into its session's tree, its output gathered in
        `choice` (its `replace` forgetting the requests it ends); the requests to abort (none
        if the session was closed, or its parent forgotten, since `prompt_for`: the request
        then runs outside the tree)."""
        with self._lock:
            nodes = self._sessions.get(c.session_id)
            if nodes is None or (c.parent is not None and c.parent not in nodes):
                return []
            if c.replace:
                if c.parent is None:
                    nodes.clear()
                else:
                    for rid in _descendants(nodes, c.parent):
                        nodes.pop(rid, None)
                    nodes[c.parent].children = []
            nodes[c.rid] = _Node(array("i", c.prompt), c.parent, choice)
            if c.parent is not None:
                nodes[c.parent].children.append(c.rid)
            return c.ends


def _descendants(nodes: dict[str, _Node], rid: str) -> list[str]:
    out, todo = [], list(nodes[rid].children)
    while todo:
        child = todo.pop()
        if child in nodes:
            out.append(child)
            todo += nodes[child].children
    return out

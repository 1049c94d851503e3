"""Stored responses of `POST /v1/responses` (`store: true`): an embedded SQLite database file,
bounded to the newest `capacity` responses.

Each row keeps the response object as it was answered (what `GET /v1/responses/{id}` returns)
and the conversation it ends, as chat messages without the instructions (what a request naming
it as `previous_response_id` continues: OpenAI does not carry instructions over).

Every call opens its own connection and closes it before returning, so the store holds no
resource between calls, may be used from any thread, and several servers may share one file
(SQLite locks it; WAL lets readers run beside a writer). Calls block: a server runs them on a
worker thread.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    response TEXT NOT NULL,
    messages TEXT NOT NULL
)
"""


class StoreUnavailable(Exception):
    """The store's file cannot be created or opened (a server setting, not a request's
    fault)."""


class ResponseStore:
    """Responses by id in the SQLite file at `path` (created, with its folder, if missing);
    storing one past `capacity` deletes the oldest."""

    def __init__(self, path: str | Path, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"response store capacity must be at least 1, got {capacity}")
        self.path = Path(path)
        self.capacity = capacity
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with closing(self._connect()) as db, db:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(_SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise StoreUnavailable(f"the response store {self.path} cannot be opened: {e}") from e

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30.0, isolation_level=None)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Store `response` (under its `id`) and the conversation it ends; the oldest
        responses beyond the capacity are deleted in the same transaction."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT OR REPLACE INTO responses (id, response, messages) VALUES (?, ?, ?)",
                    (response["id"], json.dumps(response), json.dumps(messages)),
                )
                db.execute(
                    "DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?",
                    (self.capacity,),
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The stored response object, or None."""
        row = self._row("response", response_id)
        return json.loads(row) if row is not None else None

    def messages(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation that response `response_id` ends (chat messages, its output
        last), or None if it is not stored."""
        row = self._row("messages", response_id)
        return json.loads(row) if row is not None else None

    def delete(self, response_id: str) -> bool:
        """Delete a response; whether it was stored."""
        with closing(self._connect()) as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def __len__(self) -> int:
        with closing(self._connect()) as db:
            return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def _row(self, column: str, response_id: str) -> str | None:
        with closing(self._connect()) as db:
            row = db.execute(
                f"SELECT {column} FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return row[0] if row is not None else None

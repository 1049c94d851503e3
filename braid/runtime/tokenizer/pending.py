"""`Pending`: one sample's outputs on their way from the `TokenizerManager` to its reader."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from braid.runtime.ipc.to_tokenizer import StrOut, merge_str_outs


@dataclass
class Pending:
    """One sample's outputs not yet read: at most one (later ones merge into it; it is the
    manager's own until `take` hands it over), and the reader's future while it waits."""

    out: StrOut | None = None
    waiter: asyncio.Future | None = None
    finished: bool = False

    def put(self, out: StrOut) -> None:
        if self.finished:  # nothing follows a sample's last output (a late failure notice)
            return
        self.out = out if self.out is None else merge_str_outs(self.out, out)
        if out.finish_reason:
            self.finished = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> StrOut:
        while self.out is None:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out, self.out = self.out, None
        return out

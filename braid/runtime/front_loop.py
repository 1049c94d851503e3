"""The offline `LLM`'s front-end event loop: an asyncio loop in a daemon thread, where its
tokenizer manager lives, and the calls that hop onto it from the caller's thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

SHUT_DOWN = "this LLM has been shut down"


class FrontLoop:
    def __init__(self) -> None:
        self.stopped = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="braid-tokenizer-manager", daemon=True
        )
        self._thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule `coro` on the loop, from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine) -> Any:
        """Run `coro` on the loop and wait for it. Interrupted here (Ctrl-C in the caller's
        thread), it is cancelled there, and its cleanup (which aborts the requests it
        started) has run when the interrupt goes on. After `stop` (or when `stop` cancels it
        while it runs), a `RuntimeError`."""
        if self.stopped:
            coro.close()
            raise RuntimeError(SHUT_DOWN)
        box: dict[str, Any] = {}

        async def call():
            if box.get("cancelled"):
                coro.close()
                raise asyncio.CancelledError
            box["task"] = asyncio.current_task()
            return await coro

        def cancel(done: threading.Event) -> None:
            box["cancelled"] = True
            task = box.get("task")
            if task is None or task.done():
                done.set()
            else:
                task.add_done_callback(lambda _: done.set())
                task.cancel()

        fut = self.submit(call())
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self.stopped:
                raise RuntimeError(SHUT_DOWN) from None
            raise
        except BaseException:
            if not fut.done():
                done = threading.Event()
                self.loop.call_soon_threadsafe(cancel, done)
                done.wait(30)
            raise

    def stop(self) -> None:
        """Cancel what still runs on the loop (a call another thread waits on then raises,
        its cleanup done), then stop the loop."""
        self.stopped = True

        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running() and threading.current_thread() is not self._thread:
            done = asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop)
            with contextlib.suppress(Exception):
                done.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def release(front: FrontLoop, tm: Any, media: Any) -> None:
    """Stop an engine's runtime processes, media workers and loop (`LLM.shutdown`, and when
    an `LLM` nobody holds is collected: the object's finalizer, which holds no `LLM`).
    Collected on the loop's own thread (its last reference dropped by a coroutine there, or
    the garbage collector running there), the shutdown is scheduled rather than waited for:
    waiting would block the loop that must run it."""
    if media is not None:
        media.shutdown()
    if threading.current_thread() is front._thread:
        task = front.loop.create_task(tm.shutdown())
        task.add_done_callback(lambda _: front.loop.stop())
        return
    try:
        front.call(tm.shutdown())
    finally:
        front.stop()

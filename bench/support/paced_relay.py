"""A slow link on loopback: a TCP relay per target that paces one direction to a byte rate.

``PacedRelay({name: target_port}, rate)`` listens on one port per target (``ports[name]``) and
forwards every connection to ``127.0.0.1:target_port``: client -> target at ``rate`` bytes/s
(paced piece by piece; a late wake-up is made up for, an idle spell gives no burst beyond
CATCH_UP_S), target -> client unpaced. ``pause()`` stops forwarding in both directions (bytes
wait in the relay and the socket buffers) until ``resume()``: the state of every transfer
through it is frozen meanwhile. Its asyncio loop runs on a thread of its own: ``start()``
after any fork of the caller, ``close()`` joins it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from functools import partial

PIECE_BYTES = 64 << 10
CATCH_UP_S = 0.05  # the most a paced direction may run ahead to catch up


class PacedRelay:
    def __init__(self, targets: dict[int, int], rate_bytes_per_s: float) -> None:
        self.targets = dict(targets)
        self.rate = rate_bytes_per_s
        self.listeners = {n: socket.create_server(("127.0.0.1", 0)) for n in self.targets}
        self.ports = {n: int(s.getsockname()[1]) for n, s in self.listeners.items()}
        self.forwarded: Counter[int] = Counter()  # paced bytes forwarded, per target
        self._open = threading.Event()
        self._open.set()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, name="paced-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
        for listener in self.listeners.values():
            listener.close()

    # -- the loop's thread -------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        servers = [
            await asyncio.start_server(partial(self._connection, name),
                                       sock=self.listeners[name])
            for name in self.targets
        ]
        await self._stop.wait()
        for server in servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, name: int, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.targets[name])
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer, name),
                                 self._pump(up_reader, writer, None))
        except asyncio.CancelledError:  # close(): end quietly (asyncio logs a cancelled handler)
            pass
        finally:
            for end in (writer, up_writer):
                end.close()
            self._tasks.discard(task)

    async def _gate(self) -> None:
        while not self._open.is_set():
            await asyncio.sleep(0.002)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    paced: int | None) -> None:
        loop = asyncio.get_running_loop()
        due = 0.0
        try:
            while data := await src.read(PIECE_BYTES):
                if paced is not None:
                    now = loop.time()
                    # a late wake-up (busy cores) is made up for, an idle spell is not
                    due = max(due, now - CATCH_UP_S) + len(data) / self.rate
                    if due > now:
                        await asyncio.sleep(due - now)
                await self._gate()
                dst.write(data)  # no await between the gate and the write
                if paced is not None:
                    self.forwarded[paced] += len(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

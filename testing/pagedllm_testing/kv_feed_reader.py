"""A subscriber of a node's ``GET /v1/kv_events``, reading in a thread, checking the contract
line by line and keeping the hash map the lines describe."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx


class FeedReader:
    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.url = f"{base_url}/v1/kv_events"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.status: int | None = None
        self.content_type: str | None = None
        self.snapshot: dict[str, Any] | None = None
        self.blocks: dict[str, str] = {}  # hash -> parent, as the lines left it
        self.seq = -1
        self.load: dict[str, Any] = {}
        self.stored: list[tuple[str, str]] = []  # every update's stored pairs, in order
        self.removed: list[str] = []
        self.arrivals: list[float] = []  # time.monotonic() of each line
        self.history: dict[int, dict[str, str]] = {}  # seq -> the map after that line
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            timeout = httpx.Timeout(10.0, read=10.0)
            with httpx.stream("GET", self.url, headers=self.headers, timeout=timeout) as response:
                self.status = response.status_code
                self.content_type = response.headers.get("content-type")
                if response.status_code != 200:
                    response.read()
                    return
                for line in response.iter_lines():
                    if self._stop.is_set():
                        return
                    self._take(json.loads(line))
        except BaseException as error:  # noqa: BLE001 - shown by check(), which the test calls
            self.error = error

    def _take(self, line: dict[str, Any]) -> None:
        with self._lock:
            self.arrivals.append(time.monotonic())
            if self.snapshot is None:
                assert line["type"] == "snapshot", line
                self.snapshot = line
                self.blocks = {h: parent for h, parent in line["blocks"]}
                assert len(self.blocks) == len(line["blocks"]), "a hash listed twice"
                position = {h: i for i, h in enumerate(self.blocks)}
                for h, parent in line["blocks"]:
                    assert position.get(parent, -1) < position[h], "a child before its parent"
            else:
                assert line["type"] == "update", line
                assert line["seq"] == self.seq + 1, (line["seq"], self.seq)
                for h in line["removed"]:
                    assert h in self.blocks, f"removed {h}, which was not there"
                    del self.blocks[h]
                for h, parent in line["stored"]:
                    assert h not in self.blocks, f"stored {h}, which was there already"
                    self.blocks[h] = parent
                self.stored += [tuple(pair) for pair in line["stored"]]
                self.removed += line["removed"]
            self.seq = line["seq"]
            self.load = line["load"]
            self.history[self.seq] = dict(self.blocks)

    @property
    def ended(self) -> bool:
        return not self._thread.is_alive()

    def check(self) -> None:
        """Raise what went wrong in the reading thread, if anything."""
        if self.error is not None:
            raise AssertionError(f"the feed reader failed: {self.error!r}") from self.error

    def state(self) -> dict[str, str]:
        with self._lock:
            return dict(self.blocks)

    def wait_for(self, predicate: Callable[[FeedReader], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            with self._lock:
                if predicate(self):
                    return
            if time.monotonic() > deadline or self.ended:
                self.check()
                raise AssertionError(
                    f"the feed never got there: seq {self.seq}, {len(self.blocks)} blocks"
                )
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)

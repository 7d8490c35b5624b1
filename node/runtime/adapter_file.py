"""``--lora-modules-file``: the adapters a node serves, from a file that may change while it
runs (on Kubernetes, the PagedLLM's ConfigMap, which the kubelet refreshes in place).

The file is a JSON list of ``{"name", "uri", "preload"}``: ``uri`` an absolute directory or
``hf://ORG/NAME[@REVISION]`` (downloaded into the Hugging Face cache, ``$HF_HOME``). One API
server watches it and adds and drops adapters through the scheduler, as the runtime
``/v1/load_lora_adapter`` endpoints do. The node reports ready once every ``preload`` adapter
is served; the others are added as they come. An adapter that fails (a missing directory, a
download that fails, a rank too large) is logged and tried again later, never stopping the
node. A file that cannot be read or parsed leaves the adapters as they are.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.hub import HF_URI
from pagedllm.lora.adapter_list import AdapterListError, ListedAdapter, parse_adapter_list

log = logging.getLogger(__name__)

# How often the file is read again (the kubelet itself refreshes it within a minute or so).
POLL_SECONDS = 1.0
# A failing adapter is tried again after this, doubled at each failure up to the most.
RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 60.0


# The file is not a list of adapters; the message says what is wrong.
AdapterFileError = AdapterListError
# name, uri (an absolute directory, or hf://ORG/NAME[@REVISION]) and preload.
AdapterEntry = ListedAdapter[str]


def parse_adapter_file(text: str, where: str) -> tuple[AdapterEntry, ...]:
    """The file's adapters, or AdapterFileError naming the first problem (``where``: the
    file, for the message)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise AdapterFileError(f"{where}: not JSON: {error}") from None
    return parse_adapter_list(raw, where, _checked_uri)


def _checked_uri(uri: Any, where: str) -> str:
    if not isinstance(uri, str) or not (os.path.isabs(uri) or _hub_repository(uri)):
        raise AdapterFileError(
            f"{where}.uri must be an absolute directory or hf://ORG/NAME[@REVISION], got {uri!r}"
        )
    return uri


def _hub_repository(uri: str) -> tuple[str, str | None] | None:
    """(repository, revision) of an hf:// URI naming a whole repository."""
    match = HF_URI.match(uri)
    if match is None or match["file"]:
        return None
    return match["repo"], match["revision"]


def read_adapter_file(path: str) -> tuple[AdapterEntry, ...]:
    """The adapters of the file at ``path``; AdapterFileError when it cannot be used."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise AdapterFileError(f"{path}: {error.strerror or error}") from None
    return parse_adapter_file(text, path)


def local_directory(uri: str) -> str:
    """The adapter's directory: itself, or the Hub repository downloaded into the cache
    (blocking; raises on failure)."""
    hub = _hub_repository(uri)
    if hub is None:
        return uri
    from huggingface_hub import snapshot_download

    repository, revision = hub
    return str(snapshot_download(repo_id=repository, revision=revision))


@dataclass(frozen=True)
class Answer:
    """The scheduler's answer to an update (HTTP status and message, as the endpoints)."""

    status: int
    message: str


# Load (a directory) or unload (None) an adapter through the scheduler.
Update = Callable[[str, str | None], Awaitable[Answer]]


@dataclass
class _Failing:
    entry: AdapterEntry
    error: str
    retry_at: float
    delay: float


@dataclass
class AdapterFileWatcher:
    """Keeps the node's adapters those of the file (the ones it added itself; those of
    ``--lora-modules`` are not its to drop)."""

    path: str
    update: Update
    poll_seconds: float = POLL_SECONDS
    resolve: Callable[[str], str] = local_directory
    # name -> the entry served
    served: dict[str, AdapterEntry] = field(default_factory=dict)
    preloaded: asyncio.Event = field(default_factory=asyncio.Event)
    _failing: dict[str, _Failing] = field(default_factory=dict)
    _file_error: str | None = None
    _wanted: tuple[AdapterEntry, ...] = ()

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:
                # A surprise in one look must not end the watching for the node's lifetime.
                log.exception("looking at %s failed; trying again", self.path)
            await asyncio.sleep(self.poll_seconds)

    async def sync(self) -> None:
        """One look at the file: drop what it no longer lists, add what it newly lists."""
        try:
            self._wanted = read_adapter_file(self.path)
        except AdapterFileError as error:
            if str(error) != self._file_error:
                log.error("adapters left as they are: %s", error)
            self._file_error = str(error)
            return  # the last good list stays wanted
        self._file_error = None
        wanted = {entry.name: entry for entry in self._wanted}
        for name, entry in list(self.served.items()):
            if wanted.get(name) != entry:
                await self._unload(entry)
        for name, failing in list(self._failing.items()):
            if wanted.get(name) != failing.entry:  # gone or changed: a fresh start
                del self._failing[name]
        # Preloaded ones first: readiness waits on them.
        for entry in sorted(self._wanted, key=lambda e: not e.preload):
            if entry.name not in self.served:
                await self._load(entry)
        if all(e.name in self.served for e in self._wanted if e.preload):
            self.preloaded.set()

    async def _unload(self, entry: AdapterEntry) -> None:
        answer = await self.update(entry.name, None)
        if answer.status in (200, 404):  # 404: gone already
            del self.served[entry.name]
            log.info("adapter %s (%s) dropped", entry.name, entry.uri)
        else:
            log.error("adapter %s could not be dropped: %s", entry.name, answer.message)

    async def _load(self, entry: AdapterEntry) -> None:
        failing = self._failing.get(entry.name)
        now = time.monotonic()
        if failing is not None and now < failing.retry_at:
            return
        try:
            directory = await asyncio.to_thread(self.resolve, entry.uri)
        except Exception as error:  # any download failure: network, auth, missing repo
            self._failed(entry, f"cannot fetch {entry.uri}: {error}")
            return
        answer = await self.update(entry.name, directory)
        if answer.status != 200:
            self._failed(entry, answer.message)
            return
        self._failing.pop(entry.name, None)
        self.served[entry.name] = entry
        log.info("adapter %s served from %s", entry.name, directory)

    def _failed(self, entry: AdapterEntry, error: str) -> None:
        before = self._failing.get(entry.name)
        delay = RETRY_SECONDS if before is None else min(before.delay * 2, MAX_RETRY_SECONDS)
        if before is None or before.error != error:
            what = "preload adapter (the node stays unready)" if entry.preload else "adapter"
            log.error("%s %s not served, retrying: %s", what, entry.name, error)
        self._failing[entry.name] = _Failing(entry, error, time.monotonic() + delay, delay)

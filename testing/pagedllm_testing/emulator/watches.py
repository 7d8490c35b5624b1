"""The watch stream (`?watch=true`): replay from a resourceVersion or the initial list, then
the live events, with bookmarks; one JSON event per line."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pagedllm_testing.emulator.errors import ApiError, bad_request
from pagedllm_testing.emulator.events import Watcher, translate
from pagedllm_testing.emulator.resources import ResourceType
from pagedllm_testing.emulator.selectors import Selection
from pagedllm_testing.emulator.store import KubeEmulator
from pagedllm_testing.emulator.tables import table, wants_table

DEFAULT_TIMEOUT = 1800.0  # seconds, when the client names none


@dataclass(frozen=True)
class WatchOptions:
    since: str  # resourceVersion: "" or "0" for the current state
    send_initial: bool
    bookmarks: bool
    timeout: float
    as_table: bool
    include_object: str

    @classmethod
    def from_request(cls, request: web.Request) -> WatchOptions:
        query = request.query
        since = query.get("resourceVersion", "")
        if since not in ("", "0") and not since.isdigit():
            raise bad_request(f"invalid resourceVersion: {since!r}")
        try:
            timeout = float(query.get("timeoutSeconds") or DEFAULT_TIMEOUT)
        except ValueError:
            raise bad_request(f"invalid timeoutSeconds: {query['timeoutSeconds']!r}") from None
        return cls(
            since=since,
            send_initial=truthy(query.get("sendInitialEvents")),
            bookmarks=truthy(query.get("allowWatchBookmarks")),
            timeout=timeout,
            as_table=wants_table(request.headers.get("Accept", "")),
            include_object=query.get("includeObject", "PartialObjectMetadata"),
        )


def truthy(value: str | None) -> bool:
    """A boolean query parameter as the API server reads one."""
    return value in ("true", "1", "True")


def bookmark(rtype: ResourceType, revision: str, initial_end: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"resourceVersion": revision}
    if initial_end:
        metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": metadata}


def backlog(
    em: KubeEmulator, rtype: ResourceType, selection: Selection, options: WatchOptions
) -> list[tuple[str, dict[str, Any]]]:
    """What the watch sends before the live events: the initial list, or the events after the
    client's resourceVersion (410 Expired when the log no longer reaches back that far)."""
    if options.send_initial or options.since in ("", "0"):
        return [("ADDED", obj) for obj in em.list(rtype, selection)]
    start = int(options.since)
    if em.event_log and start < em.event_log[0].resource_version - 1 and start < em.revision:
        raise ApiError(
            410,
            "Expired",
            f"too old resource version: {start} ({em.event_log[0].resource_version})",
        )
    rtype_key = (rtype.group, rtype.plural)
    events = []
    for event in em.event_log:
        if event.resource_version > start and event.rtype_key == rtype_key:
            translated = translate(event, selection)
            if translated is not None:
                events.append(translated)
    return events


class WatchStream:
    """One open watch: the response it writes to and the watcher registered in the store."""

    def __init__(
        self,
        em: KubeEmulator,
        rtype: ResourceType,
        selection: Selection,
        options: WatchOptions,
        bookmark_interval: float,
    ) -> None:
        self.em, self.rtype, self.selection, self.options = em, rtype, selection, options
        self.bookmark_interval = bookmark_interval
        self.response = web.StreamResponse(
            headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
        )

    async def run(self, request: web.Request, stopping: asyncio.Event) -> web.StreamResponse:
        em = self.em
        # Everything up to the registration of the watcher happens without yielding to the
        # event loop, so that no event can fall between the replay and the live stream.
        replay = backlog(em, self.rtype, self.selection, self.options)
        watcher = Watcher((self.rtype.group, self.rtype.plural), self.selection, asyncio.Queue())
        em.watchers.append(watcher)
        initial_end_revision = str(em.revision)
        try:
            await self.response.prepare(request)
            for event_type, obj in replay:
                await self.send(event_type, em.view(self.rtype, obj))
            if self.options.send_initial and self.options.bookmarks:
                await self.send(
                    "BOOKMARK", bookmark(self.rtype, initial_end_revision, initial_end=True)
                )
            await self.follow(watcher, stopping)
            await self.response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            em.watchers.remove(watcher)
        return self.response

    async def follow(self, watcher: Watcher, stopping: asyncio.Event) -> None:
        """The live events until the timeout, the client leaving or the server stopping."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.timeout
        while not stopping.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                event = await asyncio.wait_for(
                    watcher.queue.get(), min(remaining, self.bookmark_interval)
                )
            except asyncio.TimeoutError:
                if self.options.bookmarks:
                    await self.send("BOOKMARK", bookmark(self.rtype, str(self.em.revision)))
                continue
            if event is None:
                return
            translated = translate(event, self.selection)
            if translated is not None:
                await self.send(translated[0], self.em.view(self.rtype, translated[1]))

    async def send(self, event_type: str, obj: dict[str, Any]) -> None:
        payload = (
            table(self.rtype, [obj], self.options.include_object, self.em.revision)
            if self.options.as_table and event_type != "BOOKMARK"
            else obj
        )
        line = json.dumps({"type": event_type, "object": payload}) + "\n"
        await self.response.write(line.encode())

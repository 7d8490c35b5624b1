"""`pagedllm serve --lora-modules-file`: the adapters of a watched file. Preload adapters are
served before /health answers 200; adapters added to the file are served and those taken out
dropped while the node runs; a broken adapter is logged and tried again, never stopping the
node (a broken preload one keeps it unready); pagedllm:lora_adapter_served says which are
served. The file's parsing and the watcher's decisions are checked without processes too."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import openai
import pytest

from pagedllm.runtime.adapter_file import (
    AdapterEntry,
    AdapterFileError,
    AdapterFileWatcher,
    Answer,
    parse_adapter_file,
)
from pagedllm_testing.lora_adapters import demo_adapter
from pagedllm_testing.serve_harness import Server, run, start_server

SERVED = "pagedllm:lora_adapter_served"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": demo_adapter(root / "sql", 0, ["q_proj", "v_proj"], 8),
        "poet": demo_adapter(root / "poet", 1, ["o_proj"], 8),
    }


def write_list(path: Path, entries: list[dict[str, object]]) -> None:
    # As the kubelet refreshes a configMap volume: the new content appears at once.
    staged = path.with_suffix(".new")
    staged.write_text(json.dumps(entries))
    staged.replace(path)


def served_models(server: Server) -> set[str]:
    return {m.id for m in server.client().models.list()}


def answers(server: Server, model: str) -> str:
    return server.client().completions.create(model=model, prompt="hi", max_tokens=3).model


def test_adapters_follow_the_file(tmp_path: Path, adapters: dict[str, Path]) -> None:
    listing = tmp_path / "adapters.json"
    later = tmp_path / "later"  # not there yet: a broken adapter until it is
    write_list(
        listing,
        [
            {"name": "sql", "uri": str(adapters["sql"]), "preload": True},
            {"name": "later", "uri": str(later)},
        ],
    )
    server = start_server(
        tmp_path / "node", "--enable-lora", "--max-loras", "2", "--lora-modules-file", str(listing)
    )
    try:
        # Ready means the preload adapter is served already.
        assert "sql" in served_models(server)
        assert answers(server, "sql") == "sql"
        assert server.metric(SERVED, adapter="sql") == 1
        server.wait_until(lambda: "adapter later not served" in server.log(), what="the error")
        assert server.health() == 200  # a broken adapter that is not preloaded: still serving

        shutil.copytree(adapters["poet"], later)
        server.wait_until(lambda: "later" in served_models(server), what="the retried adapter")
        assert answers(server, "later") == "later"

        write_list(listing, [{"name": "poet", "uri": str(adapters["poet"])}])
        server.wait_until(lambda: served_models(server) == {"pagedllm-demo", "poet"}, what="poet")
        assert answers(server, "poet") == "poet"
        with pytest.raises(openai.NotFoundError):
            answers(server, "sql")
        assert server.metric(SERVED, adapter="sql") == 0
        assert server.metric(SERVED, adapter="poet") == 1

        listing.write_text("{not json")  # a broken file leaves the adapters as they are
        server.wait_until(lambda: "adapters left as they are" in server.log(), what="the error")
        assert answers(server, "poet") == "poet"
    finally:
        server.stop()


def test_a_broken_preload_adapter_keeps_the_node_unready(
    tmp_path: Path, adapters: dict[str, Path]
) -> None:
    listing = tmp_path / "adapters.json"
    missing = tmp_path / "missing"
    write_list(listing, [{"name": "sql", "uri": str(missing), "preload": True}])
    server = start_server(
        tmp_path / "node",
        "--enable-lora",
        "--lora-modules-file",
        str(listing),
        wait_ready=False,
    )
    try:
        server.wait_until(
            lambda: "preload adapter (the node stays unready) sql not served" in server.log(),
            timeout=120,
            what="the preload error",
        )
        assert server.health() == 503
        shutil.copytree(adapters["sql"], missing)
        server.wait_until(lambda: server.health() == 200, what="readiness")
        assert "sql" in served_models(server)
    finally:
        server.stop()


def test_a_file_that_cannot_serve_stops_the_command(tmp_path: Path) -> None:
    listing = tmp_path / "adapters.json"
    listing.write_text(json.dumps([{"name": "sql", "uri": "relative/dir"}]))
    result = run("serve", "--enable-lora", "--lora-modules-file", str(listing))
    assert result.returncode == 2
    assert "uri must be an absolute directory" in result.stderr
    result = run("serve", "--lora-modules-file", str(listing))
    assert result.returncode == 2
    assert "--lora-modules-file needs --enable-lora" in result.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[", "not JSON"),
        ('{"name": "a"}', "must be a list"),
        ('["a"]', "must be an object"),
        ('[{"name": "a", "uri": "/a", "rank": 8}]', "unknown fields ['rank']"),
        ('[{"name": "", "uri": "/a"}]', "'' is not an adapter name"),
        ('[{"name": "bad name", "uri": "/a"}]', "adapters.json[0].name: 'bad name' is not"),
        ('[{"name": "a-", "uri": "/a"}]', "is not an adapter name"),
        (json.dumps([{"name": "a" * 129, "uri": "/a"}]), "at most 128"),
        ('[{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]', "given twice"),
        ('[{"name": "a", "uri": "s3://bucket/a"}]', "uri must be an absolute directory"),
        ('[{"name": "a", "uri": "hf://org/name/file.gguf"}]', "uri must be an absolute"),
        ('[{"name": "a", "uri": "/a", "preload": "yes"}]', "preload must be true or false"),
    ],
)
def test_bad_files_are_refused_with_the_problem(text: str, message: str) -> None:
    with pytest.raises(AdapterFileError, match="adapters.json") as error:
        parse_adapter_file(text, "adapters.json")
    assert message in str(error.value)


def test_good_files_parse() -> None:
    text = '[{"name": "a", "uri": "/x", "preload": true}, {"name": "b", "uri": "hf://o/n@v1"}]'
    assert parse_adapter_file(text, "f") == (
        AdapterEntry("a", "/x", True),
        AdapterEntry("b", "hf://o/n@v1", False),
    )


class FakeScheduler:
    """What the scheduler answers: a directory named "broken" cannot be loaded."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}
        self.calls: list[tuple[str, str | None]] = []

    async def update(self, name: str, path: str | None) -> Answer:
        self.calls.append((name, path))
        if path is None:
            found = self.adapters.pop(name, None)
            return Answer(200, "removed") if found else Answer(404, "unknown")
        if path.endswith("broken"):
            return Answer(400, "cannot load")
        self.adapters[name] = path
        return Answer(200, "added")


def test_the_watcher_adds_drops_retries_and_swaps(tmp_path: Path) -> None:
    listing = tmp_path / "adapters.json"
    scheduler = FakeScheduler()
    downloads: list[str] = []

    def resolve(uri: str) -> str:
        downloads.append(uri)
        return "/cache/o--n" if uri.startswith("hf://") else uri

    watcher = AdapterFileWatcher(str(listing), scheduler.update, resolve=resolve)

    async def scenario() -> None:
        write_list(listing, [{"name": "a", "uri": "/broken", "preload": True}])
        await watcher.sync()
        assert not watcher.preloaded.is_set()
        await watcher.sync()  # too early for a retry: not tried again
        assert scheduler.calls == [("a", "/broken")]
        write_list(
            listing, [{"name": "a", "uri": "/a", "preload": True}, {"name": "h", "uri": "hf://o/n"}]
        )
        await watcher.sync()
        assert watcher.preloaded.is_set()
        assert scheduler.adapters == {"a": "/a", "h": "/cache/o--n"}
        assert downloads == ["/broken", "/a", "hf://o/n"]
        write_list(listing, [{"name": "a", "uri": "/a2"}])  # another directory: swapped
        await watcher.sync()
        assert scheduler.adapters == {"a": "/a2"}
        listing.unlink()  # unreadable: left as it is
        await watcher.sync()
        assert scheduler.adapters == {"a": "/a2"}

    asyncio.run(scenario())

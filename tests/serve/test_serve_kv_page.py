"""The live block map ``GET /kv`` of a real node: its key check (header or the page's cookie,
on the page's paths only), and, in headless Chromium, the page's counts of used, shared and
cached blocks against ``/metrics`` and the scheduler while requests run (parallel sampling
with n = 4, a system prompt several requests share), and the pool back to free when they end.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm_testing.browser import chromium
from pagedllm_testing.kv_feed_reader import FeedReader
from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

KEY = "kv-page-key"
# Where the test leaves its screenshot: a run's own folder, or the documentation's image when
# PAGEDLLM_KV_SCREENSHOT names it (PAGEDLLM_KV_SCREENSHOT=docs/kv_map.png refreshes it).
SCREENSHOT = Path(
    os.environ.get("PAGEDLLM_KV_SCREENSHOT")
    or Path(tempfile.gettempdir()) / f"pagedllm-kv-map-{os.getpid()}.png"
)
SYSTEM = (
    "You are the dispatcher of a harbour. Every answer names the quay, the vessel, the cargo "
    "and the hour, in that order, and never more than two sentences. Ships come from Lisbon, "
    "Rotterdam, Genoa and Piraeus; cargo is grain, timber, steel or wine. "
) * 2


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("kv-page"), api_key=KEY)
    yield server
    server.stop()


def status(url: str, **kwargs: Any) -> int:
    with httpx.stream("GET", url, timeout=10, **kwargs) as response:
        return response.status_code


def test_page_and_feed_need_the_key_as_header_or_cookie(node: Server) -> None:
    page = httpx.get(f"{node.url}/kv", timeout=10)
    assert page.status_code == 401 and "<form" in page.text  # asks for the key
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{node.url}/kv", headers=bearer, timeout=10).status_code == 200
    good, bad = {"pagedllm_api_key": KEY}, {"pagedllm_api_key": "wrong"}
    assert httpx.get(f"{node.url}/kv", cookies=good, timeout=10).status_code == 200
    assert httpx.get(f"{node.url}/kv/kv.js", cookies=good, timeout=10).status_code == 200
    assert status(f"{node.url}/kv/events", cookies=bad) == 401
    assert status(f"{node.url}/kv/events") == 401
    # The cookie is the page's only: it never authorizes the API.
    assert httpx.get(f"{node.url}/v1/models", cookies=good, timeout=10).status_code == 401
    assert httpx.get(f"{node.url}/metrics", timeout=10).status_code == 200
    with httpx.stream("GET", f"{node.url}/kv/events", cookies=good, timeout=10) as events:
        assert events.status_code == 200
        assert events.headers["content-type"].startswith("text/event-stream")
        lines = events.iter_lines()
        assert next(lines) == "event: map"
        assert next(lines).startswith('data: {"seq":')


# Rounds of requests run until enough moments compared, however fast the machine steps (a fast
# one leaves fewer moments when neither the page nor the node moved), for at most this long.
COMPARE_FOR_S = 240.0


def page_counts(driver: Any) -> dict[str, int]:
    values = driver.execute_script("return {...document.getElementById('counts').dataset}")
    return {k: int(v) for k, v in values.items() if k != "waste"}


def node_counts(node: Server) -> dict[str, int]:
    metrics = node.metrics()

    def one(name: str) -> float:
        (value,) = [v for k, v in metrics.items() if k.startswith(name + "{")]
        return value

    blocks = int(one("pagedllm:kv_cache_blocks"))
    return {
        "used": round(one("vllm:kv_cache_usage_perc") * blocks),
        "shared": int(one("pagedllm:kv_cache_shared_blocks")),
        "running": int(one("vllm:num_requests_running")),
    }


def run_requests(node: Server, errors: list[BaseException]) -> list[threading.Thread]:
    """A request with the system prompt, then, once it is cached, two more with it and one
    with n = 4 (whose samples share the prompt's blocks)."""
    client = node.client()

    def chat(user: str, n: int = 1) -> None:
        try:
            client.completions.create(
                model=DEMO_MODEL,
                prompt=SYSTEM + user,
                max_tokens=160,
                n=n,
                temperature=1.0,
                seed=7,
                extra_body={"ignore_eos": True},
            )
        except BaseException as error:  # noqa: BLE001 - the test fails on it
            errors.append(error)

    chat("Which ship is at quay 3?")  # fills the prefix cache with the system prompt
    threads = [
        threading.Thread(target=chat, args=(user, n))
        for user, n in (
            ("When does the Aurora leave?", 1),
            ("What is unloaded at quay 7?", 1),
            ("Write four arrival notices.", 4),
        )
    ]
    for thread in threads:
        thread.start()
    return threads


def test_block_map_in_chromium_matches_the_node(node: Server) -> None:
    with chromium() as driver:
        driver.get(f"{node.url}/kv")
        key_input = driver.find_element("id", "key")  # the page asks for the key once
        key_input.send_keys(KEY)
        key_input.submit()
        node.wait_until(
            lambda: (
                driver.execute_script("return document.getElementById('counts')?.dataset.seq")
                not in (None, "-1")
            ),
            timeout=60,
            what="the page's first map",
        )
        errors: list[BaseException] = []
        matched: list[dict[str, int]] = []
        shot = False

        # The map is sampled at most a few times a second and the node steps many times a
        # second, so only moments when neither moved compare; a round of requests has several
        # of them, a fast machine or one busy with other work fewer: rounds run until three
        # compared, one of them with the four samples' shared blocks.
        def enough() -> bool:
            return len(matched) >= 3 and any(
                m["shared"] > 0 and m["sequences"] >= 4 for m in matched
            )

        deadline = time.monotonic() + COMPARE_FOR_S
        while not enough() and time.monotonic() < deadline:
            threads = run_requests(node, errors)
            while any(t.is_alive() for t in threads):
                before = page_counts(driver)
                theirs = node_counts(node)
                after = page_counts(driver)
                # The page's own count of distinct blocks in the tables and the pool's figure
                # sent with the same map agree always.
                assert before["used"] == before["schedulerUsed"], before
                assert before["free"] == before["blocks"] - before["used"], before
                if before == after and all(before[k] == theirs[k] for k in theirs):
                    matched.append(before)
                if before["shared"] and not shot and before["used"] >= 40:
                    SCREENSHOT.parent.mkdir(exist_ok=True)
                    driver.save_screenshot(str(SCREENSHOT))
                    shot = True
                time.sleep(0.05)
            for thread in threads:
                thread.join()
            assert not errors, errors
        assert enough(), matched
        assert shot, "no map with shared blocks was seen"

        # Everything back to free: no block held, no reference shared; the prompts' blocks
        # stay cached (evictable, so free to allocate), exactly the hashes the KV-events feed
        # offers for reuse.
        def settled() -> bool:
            counts = page_counts(driver)
            return counts["used"] == 0 and counts["running"] == 0 and counts["waiting"] == 0

        node.wait_until(settled, timeout=30, what="the pool back to free on the page")
        reader = FeedReader(node.url, KEY)
        node.wait_until(lambda: reader.snapshot is not None, what="the KV-events snapshot")
        reader.close()
        final = page_counts(driver)
        assert final["shared"] == 0 and final["free"] == final["blocks"]
        assert final["cached"] == len(reader.snapshot["blocks"]) > 0, final
        assert node_counts(node) == {"used": 0, "shared": 0, "running": 0}
        assert node.metric("pagedllm:kv_cache_waste_perc") == 0.0
        assert SCREENSHOT.stat().st_size < 300_000

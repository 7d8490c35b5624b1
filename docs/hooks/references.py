"""The mkdocs hook that writes the reference pages when the site is built (mkdocs.yml `hooks`):
the commands' flags, the PagedLLM fields, the metrics and the benchmark results, each generated
from its source (the parsers, the CRD, the metrics' definitions, bench/results/), so that none
is a copy that can drift. The benchmark plots join the site from bench/results/ as they are,
and mermaid.js from its npm package (mermaid_js)."""

from __future__ import annotations

import mermaid_js
import reference_cli
import reference_crd
import reference_metrics
import reference_results
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

GENERATORS = (reference_cli, reference_crd, reference_metrics, reference_results)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for generator in GENERATORS:
        for path, text in generator.pages().items():
            files.append(File.generated(config, path, content=text))
    for path, png in reference_results.plots().items():
        files.append(File.generated(config, path, abs_src_path=str(png)))
    files.append(
        File.generated(config, mermaid_js.SITE_PATH, abs_src_path=str(mermaid_js.installed()))
    )
    return files

"""Hugging Face Hub sources, as `pagedllm download` and the node's adapter list name them."""

from __future__ import annotations

import re

# hf://ORG/NAME[@REVISION][/FILE.gguf]: a repository, or one GGUF file of it. The revision is
# matched lazily, so that one holding slashes (refs/pr/1) still leaves the file name apart.
HF_URI = re.compile(
    r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(@(?P<revision>[\w./-]+?))?"
    r"(/(?P<file>[\w.-]+\.gguf))?$"
)
HF_URI_FORMS = "hf://ORG/NAME[@REVISION] or hf://ORG/NAME[@REVISION]/FILE.gguf"

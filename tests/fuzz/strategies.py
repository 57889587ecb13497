"""Hypothesis strategies shared by the fuzz targets: JSON values, JSON trees shaped like a pydantic
model's keys, and mutations of existing JSON documents and byte strings."""
from __future__ import annotations

import os
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from pydantic import BaseModel

from rayzero.config.convert import model_in

# Scalars a config or manifest meets in the wild, edge cases first: DeepSpeed's "auto", numbers as
# strings, huge and negative numbers, NaN/Infinity (Python's json reads them), empty things.
EDGE_STRINGS = st.sampled_from(["auto", "", "none", "true", "0", "1e9", "-1", "cpu", "nvme", "fp16", "bf16",
                                "global_step1", "../x", "a/b", "\x00", "é"])
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64),
    st.sampled_from([0, 1, -1, 2, 3, 2**31, 2**53 + 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    EDGE_STRINGS, st.text(max_size=12),
)
JSON = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                    | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=8)


def model_tree(model: type[BaseModel], depth: int = 3) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts whose keys are mostly `model`'s JSON keys (aliases and attribute names) and whose values
    are mostly sections of the nested models (else arbitrary JSON), with an unknown key now and then."""
    sections: dict[str, st.SearchStrategy[Any]] = {}
    scalars: list[str] = []
    for name, info in model.model_fields.items():
        nested = model_in(info.annotation)
        for key in {name, info.alias or name}:
            if nested is not None and depth > 0:
                sections[key] = st.one_of(model_tree(nested, depth - 1), model_tree(nested, depth - 1), JSON)
            else:
                scalars.append(key)
    entries = [st.tuples(st.sampled_from(sorted(scalars)), JSON)] * 2 if scalars else []
    if sections:
        entries += [st.sampled_from(sorted(sections)).flatmap(lambda key: st.tuples(st.just(key), sections[key]))] * 2
    entries.append(st.tuples(st.text(min_size=1, max_size=10), JSON))  # an unknown key
    return st.lists(st.one_of(entries), max_size=6).map(dict)


def examples(count: int) -> settings:
    """`count` examples in the normal run; under `make fuzz` RAYZERO_FUZZ_FACTOR (default 50) times more."""
    fuzzing = os.environ.get("RAYZERO_FUZZ_PROFILE") == "fuzz"
    factor = float(os.environ.get("RAYZERO_FUZZ_FACTOR", "50")) if fuzzing else 1
    return settings(max_examples=max(1, round(count * factor)))


@st.composite
def mutated_json(draw: st.DrawFn, document: Any) -> Any:
    """`document` with a few random edits: a value replaced, a key removed, an unknown key added."""
    document = _copy(document)
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(document))
        path = draw(st.sampled_from(paths))
        parent, key = _locate(document, path)
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        if parent is None:  # the root: replace it
            return draw(JSON) if action == "replace" else document
        if action == "replace":
            parent[key] = draw(JSON)
        elif action == "remove":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=10))] = draw(JSON)
        else:
            parent.insert(key, draw(JSON))
    return document


def _copy(document: Any) -> Any:
    if isinstance(document, dict):
        return {key: _copy(value) for key, value in document.items()}
    if isinstance(document, list):
        return [_copy(value) for value in document]
    return document


def _paths(document: Any, prefix: tuple = ()):
    yield prefix
    if isinstance(document, dict):
        for key, value in document.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield from _paths(value, (*prefix, index))


def _locate(document: Any, path: tuple) -> tuple[Any, Any]:
    if not path:
        return None, None
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    return parent, path[-1]


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` truncated, with bits flipped, bytes overwritten or a span duplicated."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["truncate", "flip", "overwrite", "duplicate"]))
        if not data:
            break
        index = draw(st.integers(0, len(data) - 1))
        if action == "truncate":
            del data[index:]
        elif action == "flip":
            data[index] ^= 1 << draw(st.integers(0, 7))
        elif action == "overwrite":
            patch = draw(st.binary(min_size=1, max_size=16))
            data[index:index + len(patch)] = patch
        else:
            end = draw(st.integers(index, min(len(data), index + 64)))
            data[index:index] = data[index:end]
    return bytes(data)

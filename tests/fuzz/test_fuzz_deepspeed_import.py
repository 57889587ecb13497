"""Fuzz `rayzero checkpoint import-deepspeed`: real DeepSpeed 0.19.8 ZeRO 1-3 checkpoints
(tests/data/deepspeed_checkpoints) with a file's bytes mutated, its pickled dict edited (keys
dropped, values swapped for other types or tensors of other shapes), a rank file removed or added,
or `latest` changed. Property: the import writes a checkpoint, or raises a RayZeroError naming the
DeepSpeed checkpoint's directory or file; it never leaves a partial output, never touches the input."""
from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import JSON, examples, mutated_bytes

from rayzero.checkpoint.deepspeed_import import (
    FragmentAddress,
    LossScalerState,
    ZeroStage,
    import_deepspeed,
    load_deepspeed_file,
)
from rayzero.checkpoint.manifest import committed_tags
from rayzero.config.errors import RayZeroError

SEEDS = Path(__file__).parents[1] / "data" / "deepspeed_checkpoints"
TENSORS = st.builds(lambda shape, dtype: torch.zeros(shape, dtype=dtype),
                    st.lists(st.integers(0, 4), max_size=3), st.sampled_from([torch.float32, torch.int64, torch.bool]))


def _plain(value: Any) -> Any:
    """DeepSpeed's pickled globals as plain values, so an edited file pickles without them."""
    if isinstance(value, ZeroStage):
        return int(value.args[0])
    if isinstance(value, (LossScalerState, FragmentAddress)):
        return {key: _plain(item) for key, item in vars(value).items()}
    if isinstance(value, dict):
        return type(value)((key, _plain(item)) for key, item in value.items()) if isinstance(value, OrderedDict) \
            else {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_plain(item) for item in value)
    return value


def _containers(value: Any, path: tuple = ()):
    if isinstance(value, dict):
        yield path, value
        for key, item in value.items():
            yield from _containers(item, (*path, key))
    elif isinstance(value, list):
        yield path, value
        for index, item in enumerate(value):
            yield from _containers(item, (*path, index))


@st.composite
def _edited(draw: st.DrawFn, state: dict) -> dict:
    state = _plain(state)
    for _ in range(draw(st.integers(1, 3))):
        _, container = draw(st.sampled_from(list(_containers(state))))
        if not container:
            continue
        key = draw(st.sampled_from(list(container.keys()) if isinstance(container, dict) else range(len(container))))
        if draw(st.booleans()) and isinstance(container, dict):
            del container[key]
        else:
            container[key] = draw(st.one_of(JSON, TENSORS, st.builds(torch.Size, st.lists(st.integers(0, 9), max_size=3))))
    return state


@examples(60)
@given(data=st.data(), stage=st.sampled_from([1, 2, 3]),
       kind=st.sampled_from(["bytes", "edit", "edit", "remove", "extra-rank", "latest"]))
def test_mutated_deepspeed_checkpoints(tmp_path_factory, data, stage, kind):
    work = tmp_path_factory.mktemp("ds")
    location = work / "ds"
    shutil.copytree(SEEDS / f"stage{stage}", location)
    tag_dir = location / "global_step3"
    files = sorted(tag_dir.glob("*.pt"))
    target = data.draw(st.sampled_from(files), label="file")
    if kind == "bytes":
        target.write_bytes(data.draw(mutated_bytes(target.read_bytes()), label="bytes"))
    elif kind == "edit":
        torch.save(data.draw(_edited(load_deepspeed_file(str(target))), label="edited"), target)
    elif kind == "remove":
        target.unlink()
    elif kind == "extra-rank":
        shutil.copyfile(files[-1], tag_dir / files[-1].name.replace("rank_1", "rank_2"))
    else:
        (location / "latest").write_bytes(data.draw(st.one_of(
            st.sampled_from([b"../global_step3", b"global_step9", b"", b"/etc", b"global_step3\x00"]),
            st.binary(max_size=20)), label="latest"))
    before = {path: path.read_bytes() for path in location.rglob("*") if path.is_file()}
    output = work / "out"
    try:
        written = import_deepspeed(str(location), str(output))
    except RayZeroError as error:
        assert str(location) in str(error) or "--tag" in str(error), error  # names the checkpoint or the flag
        assert not output.exists() or not any(output.iterdir()), sorted(output.rglob("*"))
    else:
        assert os.path.isfile(os.path.join(written, "manifest.json"))
        assert [tag for _, tag in committed_tags(str(output))] == ["global_step3"]
    assert {path: path.read_bytes() for path in location.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_seeds_import(tmp_path, stage):
    """The unmutated seeds are real, importable DeepSpeed checkpoints (else the fuzzer tests nothing)."""
    written = import_deepspeed(str(SEEDS / f"stage{stage}"), str(tmp_path))
    assert written.endswith("global_step3")


# --- regressions: the target found 27 distinct crashes (KeyError, IndexError, TypeError,
# AttributeError, ... deep in the reassembly), now one RayZeroValueError naming the directory -------
def _seed(tmp_path, stage: int) -> Path:
    location = tmp_path / "ds"
    shutil.copytree(SEEDS / f"stage{stage}", location)
    return location


def _model_file(location: Path) -> Path:
    return min((location / "global_step3").glob("*model_states.pt"))


def test_regression_a_missing_key_is_named(tmp_path):
    location = _seed(tmp_path, 2)
    state = _plain(load_deepspeed_file(str(_model_file(location))))
    del state["param_shapes"]
    torch.save(state, _model_file(location))
    with pytest.raises(RayZeroError, match=r"global_step3: not a DeepSpeed ZeRO 1-3 checkpoint rayzero can import "
                                           r"\(missing key 'param_shapes'\)"):
        import_deepspeed(str(location), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_regression_shapes_that_do_not_cover_the_partitions_are_refused_not_misplaced(tmp_path, stage):
    """A smaller first shape used to shift every later weight silently (DeepSpeed's zero_to_fp32 refuses)."""
    location = _seed(tmp_path, stage)
    state = _plain(load_deepspeed_file(str(_model_file(location))))
    shapes = state["param_shapes"][0]
    first = next(iter(shapes))
    shapes[first] = torch.Size([1, *shapes[first][1:]])
    for path in (location / "global_step3").glob("*model_states.pt"):
        torch.save(state, path)
    with pytest.raises(RayZeroError, match="the parameter shapes use .* elements of the .* do not match"):
        import_deepspeed(str(location), str(tmp_path / "out"))


def test_regression_latest_naming_a_path_is_refused(tmp_path):
    location = _seed(tmp_path, 1)
    (location / "latest").write_text("../global_step3\n")
    with pytest.raises(RayZeroError, match=r"the tag in .*latest = '../global_step3' contains a path separator"):
        import_deepspeed(str(location), str(tmp_path / "out"))
    with pytest.raises(RayZeroError, match=r"--tag = '\.\./x'"):
        import_deepspeed(str(location), str(tmp_path / "out"), tag="../x")

"""Fuzz checkpoint loading: a real two-checkpoint save directory with its newer checkpoint's shard
file and manifest truncated, bit-flipped, overwritten, swapped for the older one's, or edited as
JSON (with or without the checksum made to match). Readers: the engine's loader (whole-file and
streamed), `rayzero checkpoint consolidate`, `ls` and `verify`.

Property: a load returns data that is exactly one of the two checkpoints' (when the manifest was not
edited: the checksum guarantees it), or raises a RayZeroError naming the file; consolidate writes
its whole output or nothing; the CLI exits 0 or 1 with a message; nothing outside the save directory
changes and no file inside it disappears (a corrupt copy is only renamed to `*.corrupt`)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import examples, mutated_bytes, mutated_json

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.cli import main as checkpoint_cli
from rayzero.checkpoint.consolidate import consolidate
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.shard_file import file_checksum
from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.errors import RayZeroError

SHAPES = {"module/layer.weight": ((6, 5), torch.float32), "module/layer.bias": ((6,), torch.bfloat16),
          "master/layer.weight": ((6, 5), torch.float32), "optim/step/layer.weight": ((1,), torch.int64)}
SPECS = [ShardSpec(name, shape, dtype, 0, torch.Size(shape).numel()) for name, (shape, dtype) in SHAPES.items()]
SHARD = "rank00000.safetensors"


def _values(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {spec.name: (torch.randn(spec.global_numel, generator=generator) * 100).to(spec.dtype) for spec in SPECS}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("template") / "ckpt"
    checkpointer = Checkpointer(CheckpointOptions(async_save=False, keep_last=0))
    for step in (1, 2):
        values = _values(step)
        checkpointer.save(str(root), f"global_step{step}", step, 1,
                          [ShardedTensor(spec, values[spec.name]) for spec in SPECS], extra_state={"global_steps": step})
    checkpointer.wait()
    return root


def _snapshot(directory) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(folder, name), directory): _read(os.path.join(folder, name))
            for folder, _, names in os.walk(directory) for name in names}


MUTATIONS = st.sampled_from(["shard-bytes", "shard-bytes-checksum-updated", "shard-swapped", "manifest-json",
                             "manifest-bytes", "latest-bytes"])


def _mutate(data: st.DataObject, tag_dir: str, root: str, kind: str) -> bool:
    """Apply `kind`; True when the manifest still tells the truth (loaded data must then be exact)."""
    shard, manifest = os.path.join(tag_dir, SHARD), os.path.join(tag_dir, "manifest.json")
    body = json.loads(_read(manifest))
    if kind == "shard-bytes":
        _write(shard, data.draw(mutated_bytes(_read(shard)), label="shard"))
        return True
    if kind == "shard-bytes-checksum-updated":  # a mismatched pair: the manifest vouches for the new bytes
        _write(shard, data.draw(mutated_bytes(_read(shard)), label="shard"))
        body["files"][SHARD].update(size=os.path.getsize(shard), checksum=file_checksum(shard))
        _write(manifest, json.dumps(body).encode())
        return False
    if kind == "shard-swapped":
        shutil.copyfile(os.path.join(root, "global_step1", SHARD), shard)
        if data.draw(st.booleans(), label="checksum updated"):
            body["files"][SHARD].update(size=os.path.getsize(shard), checksum=file_checksum(shard))
            _write(manifest, json.dumps(body).encode())
            return False
        return True
    if kind == "manifest-json":
        _write(manifest, json.dumps(data.draw(mutated_json(body), label="manifest"), allow_nan=True).encode())
        return False
    if kind == "manifest-bytes":
        _write(manifest, data.draw(mutated_bytes(_read(manifest)), label="manifest bytes"))
        return False
    latest = os.path.join(root, "latest")
    _write(latest, data.draw(st.one_of(mutated_bytes(_read(latest)), st.binary(max_size=40)), label="latest"))
    return True


def _read(path: str) -> bytes:
    with open(path, "rb") as source:
        return source.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as out:
        out.write(data)


def _check_load(root: str, truthful: bool, stream: bool) -> None:
    destinations = ({spec.name: torch.empty(spec.global_numel, dtype=spec.dtype) for spec in SPECS}
                    if stream else None)
    try:
        loaded = Checkpointer().load(root, SPECS, destinations=destinations)
        got = {spec.name: loaded.read(spec).clone() for spec in SPECS}
    except RayZeroError as error:
        assert str(error), error
        return
    if truthful:  # the checksums vouch for these bytes: exactly step 2's, or step 1's after a fallback
        step = loaded.manifest.step
        assert step in (1, 2) and all(torch.equal(got[name], value) for name, value in _values(step).items())


def _check_consolidate(tag_dir: str, output: str) -> None:
    try:
        consolidate(tag_dir, output)
    except RayZeroError as error:
        assert str(error)
        assert not os.path.exists(output) and not os.path.exists(output + ".tmp"), "a partial output was left"


@examples(120)
@given(data=st.data(), kind=MUTATIONS, stream=st.booleans())
@example(data=None, kind="regression: manifest lists a file outside", stream=False)
def test_mutated_checkpoints(template, tmp_path_factory, capsys, data, kind, stream):
    work = tmp_path_factory.mktemp("fuzz")
    root = str(work / "ckpt")
    shutil.copytree(template, root)
    sentinel = work / "outside.txt"
    sentinel.write_text("not a checkpoint")
    tag_dir = os.path.join(root, "global_step2")
    if data is None:  # see test_names.py: the escape this target would find first
        body = json.loads(_read(os.path.join(tag_dir, "manifest.json")))
        body["files"]["../../outside.txt"] = body["files"].pop(SHARD)
        _write(os.path.join(tag_dir, "manifest.json"), json.dumps(body).encode())
        truthful = False
    else:
        truthful = _mutate(data, tag_dir, root, kind)
    before = _snapshot(root)

    _check_load(root, truthful, stream)
    _check_consolidate(tag_dir, str(work / "consolidated.safetensors"))
    for command in (["ls", root], ["verify", root], ["verify", "--all", root]):
        assert checkpoint_cli(command) in (0, 1)
    capsys.readouterr()

    assert sentinel.read_text() == "not a checkpoint"
    after = _snapshot(root)
    for path, content in before.items():  # nothing vanished; a corrupt copy is only set aside
        assert after.get(path, after.get(path + ".corrupt")) == content, path


# --- regressions: each crash the target found, fixed, kept as a plain test ----------------------
def _copy_template(template, tmp_path) -> tuple[str, str]:
    root = str(tmp_path / "ckpt")
    shutil.copytree(template, root)
    return root, os.path.join(root, "global_step2")


def _edit_manifest(tag_dir: str, edit) -> None:
    path = os.path.join(tag_dir, "manifest.json")
    body = json.loads(_read(path))
    edit(body)
    _write(path, json.dumps(body).encode())


@pytest.mark.parametrize("numpy_state", [["MT19937", -1, 623, 0, 0.0], ["MT19937", None, 623, 0, 0.0],
                                         ["MT19937", [0] * 623, 623, 0, 0.0], ["PCG64", [0] * 624, 0, 0, 0.0]])
def test_regression_a_malformed_rng_state_is_refused_before_touching_a_generator(template, tmp_path, numpy_state):
    """Found: OverflowError / TypeError / ValueError / IndexError from numpy.random.set_state."""
    root, tag_dir = _copy_template(template, tmp_path)
    _edit_manifest(tag_dir, lambda body: body["rank_states"][0]["rng"].update(numpy=numpy_state))
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with pytest.raises(RayZeroError, match=r"checkpoint RNG state of rank 0 is malformed \(numpy"):
        Checkpointer().load(root, SPECS)
    assert torch.equal(torch.get_rng_state(), before)  # nothing applied


def test_regression_a_rank_state_without_rng_is_refused(template, tmp_path):
    """Found by the long run (make fuzz): KeyError 'rng' when a manifest's rank state lacked it."""
    root, tag_dir = _copy_template(template, tmp_path)
    _edit_manifest(tag_dir, lambda body: body["rank_states"][0].pop("rng"))
    with pytest.raises(RayZeroError, match="checkpoint RNG state of rank 0 is missing"):
        Checkpointer().load(root, SPECS)


def test_regression_consolidate_names_a_rejected_manifest(template, tmp_path):
    """Found: AttributeError ('NoneType' has no attribute 'tensors') when the manifest was refused."""
    _, tag_dir = _copy_template(template, tmp_path)
    _edit_manifest(tag_dir, lambda body: body["files"].update({"../../outside": body["files"][SHARD]}))
    with pytest.raises(RayZeroError, match=r"global_step2/manifest.json: checkpoint manifest: a file name"):
        consolidate(tag_dir, str(tmp_path / "out.safetensors"))
    assert not os.path.exists(tmp_path / "out.safetensors")


def test_regression_consolidate_names_a_missing_shard_and_leaves_no_partial_output(template, tmp_path):
    """Found: FileNotFoundError from consolidate after a load had set a corrupt shard aside."""
    _, tag_dir = _copy_template(template, tmp_path)
    os.replace(os.path.join(tag_dir, SHARD), os.path.join(tag_dir, SHARD + ".corrupt"))
    output = str(tmp_path / "out.safetensors")
    with pytest.raises(RayZeroError, match=r"rank00000.safetensors does not match its manifest: it cannot be read"):
        consolidate(tag_dir, output)
    assert not os.path.exists(output) and not os.path.exists(output + ".tmp")

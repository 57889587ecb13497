"""[Note: names that become paths]: run names and checkpoint tags are one plain path component after
percent-decoding, at every entry (RunConfig, `fit`, `rayzero run --name`, the control plane's run
lookup, save/load tags), and names read back from storage (a manifest, `latest`) are checked the
same way before they become paths (issue 22, section 1)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

import rayzero
from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.loader import NoCheckpointError
from rayzero.checkpoint.manifest import Manifest, read_latest, read_manifest
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.shard_file import file_checksum
from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.errors import RayZeroValueError
from rayzero.config.k8s_job import DNS_SUBDOMAIN_PATTERN
from rayzero.config.names import MAX_NAME_BYTES, check_name, name_problem
from rayzero.config.run_settings import RunConfig
from rayzero.control_api.discovery import run_uri

pytestmark = pytest.mark.unit

ESCAPING = ["..%2Fescaped", "..%252Fescaped", "a/b", "a\\b", "..", ".", "x..y", "%2e%2e", "a\x00b", "a\nb",
            "a\u202eb", "", " padded", "run?endpoint_override=evil.example", "a#frag", "50%", "x" * 254]


@pytest.mark.parametrize("name", ESCAPING)
def test_every_escaping_or_ambiguous_name_is_refused_naming_the_field(name):
    with pytest.raises(RayZeroValueError) as caught:
        check_name(name, "RunConfig.name")
    message = str(caught.value)
    assert message.startswith(f"RunConfig.name = {name!r} ") and "use one plain directory name" in message


def test_the_decoded_form_is_what_is_checked_and_said():
    problem = name_problem("..%2Fescaped")
    assert problem.startswith("contains a path separator") and "decodes to '../escaped'" in problem


@pytest.mark.parametrize("name", ["global_step100", "gpt2-small_run.3", "epoch=3", "ünïcode-名前", "a" * MAX_NAME_BYTES])
def test_ordinary_names_pass(name):
    assert check_name(name, "tag") == name


def test_every_kubernetes_object_name_is_a_valid_run_name():
    # the operator passes a RayZeroJob's metadata.name as `rayzero run --name`
    import re

    for name in ["a", "my-job", "job.v2", "a" * 253, "x-1.y-2.z"]:
        assert re.match(DNS_SUBDOMAIN_PATTERN, name)
        assert name_problem(name) is None, name


def test_run_config_refuses_a_percent_encoded_escape_with_its_reason():
    with pytest.raises(ValidationError) as caught:
        RunConfig(name="..%2Fescaped")
    error = caught.value.errors()[0]
    assert error["loc"] == ("name",) and "decodes to '../escaped'" in error["msg"]


def test_fit_refuses_the_name_before_creating_anything(tmp_path):
    storage = tmp_path / "runs"
    # a RunConfig built without validation still meets the check where fit resolves the name
    run = RunConfig.model_construct(name="..%2Fescaped", storage=storage.as_uri(), resume_from=None,
                                    progress_interval_s=5.0)
    with pytest.raises(RayZeroValueError, match=r"RunConfig.name = '\.\.%2Fescaped' contains a path separator"):
        rayzero.fit(lambda: None, config={"train_micro_batch_size_per_gpu": 1}, run=run,
                    scaling=rayzero.ScalingConfig(num_workers=64))
    assert not (tmp_path / "escaped").exists() and not storage.exists()


def test_rayzero_run_refuses_the_name_and_says_why(tmp_path):
    (tmp_path / "loop.py").write_text("def loop():\n    pass\n")
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    done = subprocess.run([sys.executable, "-m", "rayzero.cli", "run", "loop.py:loop", "--workers", "1",
                           "--config", "ds.json",
                           "--name", "..%2Fescaped", "--storage", str(tmp_path / "runs")],
                          check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--name ..%2Fescaped: run name '..%2Fescaped' contains a path separator (it decodes to '../escaped'" \
        in done.stderr, done.stderr
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "runs").exists()


def test_the_control_plane_lookup_refuses_it_too(tmp_path):
    with pytest.raises(RayZeroValueError, match="run name"):
        run_uri("..%2Fescaped", tmp_path.as_uri())
    assert run_uri("exp1", tmp_path.as_uri()).endswith("/exp1")


SPEC = ShardSpec("module/w", (4,), torch.float32, 0, 4)


def _save(root: str, tag: str, value: float = 1.0) -> Checkpointer:
    checkpointer = Checkpointer(CheckpointOptions(async_save=False, keep_last=0))
    checkpointer.save(root, tag, 1, 0, [ShardedTensor(SPEC, torch.full((4,), value))])
    checkpointer.wait()
    return checkpointer


@pytest.mark.parametrize("tag", ["..%2Fescaped", "../escaped", "latest", "a\x00"])
def test_checkpoint_tags_are_checked_on_save_and_load(tmp_path, tag):
    root = str(tmp_path / "ckpt")
    checkpointer = Checkpointer(CheckpointOptions(async_save=False))
    with pytest.raises(RayZeroValueError, match=r"save_checkpoint\(tag="):
        checkpointer.save(root, tag, 1, 0, [ShardedTensor(SPEC, torch.ones(4))])
    assert not (tmp_path / "escaped").exists()
    if tag != "latest":
        with pytest.raises(RayZeroValueError, match=r"load_checkpoint\(tag=\.\.\.\)"):
            checkpointer.load(root, [SPEC], tag=tag)


def test_the_engine_checks_its_tags(tmp_path):
    model = torch.nn.Linear(4, 4)
    engine = rayzero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
                                                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    try:
        with pytest.raises(RayZeroValueError, match="decodes to '../escaped'"):
            engine.save_checkpoint(str(tmp_path / "ckpt"), tag="..%2Fescaped")
        with pytest.raises(RayZeroValueError, match=r"load_checkpoint\(tag=\.\.\.\)"):
            engine.load_checkpoint(str(tmp_path / "ckpt"), tag="../../escaped")
    finally:
        engine.close()
    assert not (tmp_path / "escaped").exists()


def _tamper(tag_dir: str, edit) -> None:
    path = os.path.join(tag_dir, "manifest.json")
    with open(path) as source:
        body = json.load(source)
    edit(body)
    with open(path, "w") as out:
        json.dump(body, out)


def test_a_manifest_naming_files_outside_its_directory_is_not_loaded_and_touches_nothing(tmp_path):
    root = str(tmp_path / "ckpt")
    _save(root, "global_step1", 1.0)
    _save(root, "global_step2", 2.0)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious, not a checkpoint")
    tag_dir = os.path.join(root, "global_step2")

    def point_outside(body):  # the file entry and the piece both name ../../victim.bin
        entry = body["files"].pop("rank00000.safetensors")
        body["files"]["../../victim.bin"] = entry
        for tensor in body["tensors"].values():
            tensor["pieces"] = [["../../victim.bin", start, end] for _, start, end in tensor["pieces"]]

    _tamper(tag_dir, point_outside)
    assert read_manifest(tag_dir) is None  # refused, with a warning naming the field
    with pytest.raises(RayZeroValueError, match="a file name in `files`"):
        Manifest.from_json(pathlib.Path(tag_dir, "manifest.json").read_text())
    loaded = Checkpointer().load(root, [SPEC])
    assert loaded.manifest.step == 1 and torch.equal(loaded.read(SPEC), torch.full((4,), 1.0))
    assert victim.read_bytes() == b"precious, not a checkpoint"  # not read as a shard, not renamed .corrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "victim.bin"]


def test_a_manifest_whose_tag_or_latest_points_outside_is_ignored(tmp_path):
    root = str(tmp_path / "ckpt")
    _save(root, "global_step1")
    _tamper(os.path.join(root, "global_step1"), lambda body: body.update(tag="../../escaped"))
    assert read_manifest(os.path.join(root, "global_step1")) is None
    with open(os.path.join(root, "latest"), "w") as out:
        out.write("../../escaped\n")
    assert read_latest(root) is None
    with pytest.raises(NoCheckpointError):
        Checkpointer().load(root, [SPEC])


def test_a_checksum_matching_shard_with_the_wrong_contents_is_refused_by_name(tmp_path):
    """A manifest and a shard that agree on the checksum but not on the tensors (a mismatched pair)."""
    root = str(tmp_path / "ckpt")
    _save(root, "global_step1")
    tag_dir = os.path.join(root, "global_step1")
    _tamper(tag_dir, lambda body: body["tensors"]["module/w"].update(shape=[8], pieces=[["rank00000.safetensors", 0, 8]]))
    spec = ShardSpec("module/w", (8,), torch.float32, 0, 8)
    shard = os.path.join(tag_dir, "rank00000.safetensors")
    assert file_checksum(shard) == read_manifest(tag_dir).files["rank00000.safetensors"].checksum
    with pytest.raises(RayZeroValueError, match="rank00000.safetensors"):
        Checkpointer().load(root, [spec]).read(spec)

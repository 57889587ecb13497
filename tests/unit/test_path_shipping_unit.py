"""Shipping a loop without a cluster (issue 13 item 1): the pickling and file-target rules."""
from __future__ import annotations

import sys
import threading
import types

import pytest
import torch
import torch.distributed as dist

from rayzero.driver.shipping import FileTarget, ShippedLoop, UnshippableLoopError, ship

LOCK = threading.Lock()


def ops_loop(config):
    return torch.ops.aten.add.Tensor(torch.ones(1), torch.ones(1)).item(), dist.is_initialized()


def config_loop(config):
    model = types.SimpleNamespace(config=None)  # like an HF model: reading `model.config` puts
    return model.config, dist.is_available()  # `config` in the code's names, so cloudpickle ships
    # torch.distributed.config along with `dist`: a ConfigModule, which it cannot pickle


def test_torch_ops_and_config_modules_ship_by_name():
    import importlib

    import ray.cloudpickle

    # a ConfigModule, as transformers or torch._dynamo leave it imported in a real script
    importlib.import_module("torch.distributed.config")

    module = sys.modules[__name__]
    for loop, expected in ((ops_loop, (2.0, False)), (config_loop, (None, True))):
        ray.cloudpickle.register_pickle_by_value(module)  # as a script's loop travels: by value
        try:
            with pytest.raises(TypeError):
                ray.cloudpickle.dumps(loop)  # what Ray's own serializer does with it
        finally:
            ray.cloudpickle.unregister_pickle_by_value(module)
        shipped = ship(loop)
        assert isinstance(shipped, ShippedLoop)
        assert ray.cloudpickle.loads(ray.cloudpickle.dumps(shipped))({}) == expected


def test_the_unpicklable_object_is_named_in_one_line():
    def loop(config):
        with LOCK:
            pass

    with pytest.raises(UnshippableLoopError) as raised:
        ship(loop)
    message = str(raised.value)
    assert "global 'LOCK' (_thread.lock)" in message and "\n" not in message


def test_a_file_target_is_found_where_a_worker_has_it(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("def loop(config):\n    return config['x'] * 2\n")
    target = FileTarget("/nowhere/project/train.py", "project/train.py", "loop", True)
    monkeypatch.chdir(tmp_path)  # a runtime_env working_dir holding the file at its root
    assert target({"x": 21}) == 42
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(FileNotFoundError, match="ray job submit --working-dir"):
        target({"x": 1})

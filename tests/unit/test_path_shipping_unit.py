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


def test_a_user_module_object_travels_as_source_and_is_built_on_the_worker(tmp_path):
    import ray.cloudpickle

    from rayzero.driver.shipping import user_module

    source = "import threading\nLOCK = threading.Lock()\nVALUE = 41\n\ndef bump():\n    return VALUE + 1\n"
    file = tmp_path / "rayzero_test_unimportable_helpers.py"  # not on sys.path: not importable by name
    file.write_text(source)
    module = user_module("rayzero_test_unimportable_helpers", source, str(file))
    try:
        assert module.bump() == 42  # executed from source: its lock was made here, not unpickled

        def loop(config):
            return module.bump()

        ray.cloudpickle.register_pickle_by_value(module)
        try:
            payload = ship(loop).payload
        finally:
            ray.cloudpickle.unregister_pickle_by_value(module)
        del sys.modules["rayzero_test_unimportable_helpers"]  # as on a worker that never saw it
        assert ray.cloudpickle.loads(payload)({}) == 42
        assert sys.modules["rayzero_test_unimportable_helpers"] is not module  # rebuilt from its source
    finally:
        sys.modules.pop("rayzero_test_unimportable_helpers", None)

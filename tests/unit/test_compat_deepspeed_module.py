"""The `deepspeed` package of rayzero's compatibility layer ([Note: the DeepSpeed compatibility
layer]): what it answers, what it refuses, and that it is `import deepspeed` only where its site
directory is on the path (a real DeepSpeed install stays itself everywhere else)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rayzero.compat import SITE_DIR
from rayzero.compat.accelerator import RayZeroAccelerator
from rayzero.compat.engine import clone_tensors_for_torch_save
from rayzero.compat.optimizers import DeepSpeedCPUAdam, FusedAdam
from rayzero.compat.refused import DeepSpeedNameRefused
from rayzero.config.errors import RayZeroError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.metadata, importlib.util, json, sys
import rayzero.compat, rayzero.compat.engine  # importing the layer itself changes nothing
spec = importlib.util.find_spec("deepspeed")
out = {"origin": spec.origin if spec else None}
try:
    out["version"] = importlib.metadata.version("deepspeed")
except importlib.metadata.PackageNotFoundError:
    out["version"] = None
if "--detect" in sys.argv:
    from transformers.integrations.deepspeed import is_deepspeed_available as transformers_sees
    from accelerate.utils import is_deepspeed_available as accelerate_sees
    from accelerate.utils.versions import compare_versions
    out["detected"] = [bool(transformers_sees()), bool(accelerate_sees()), compare_versions("deepspeed", ">=", "0.16.4")]
    import deepspeed
    out["engine"] = deepspeed.DeepSpeedEngine.__module__
    out["schedules"] = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
print("PROBE " + json.dumps(out))
"""


def _probe(*extra_path: str, detect: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra_path, str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", PROBE, *(["--detect"] if detect else [])], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))[6:])


def test_deepspeed_is_the_compat_package_only_with_its_site_directory_on_the_path():
    inside = _probe(SITE_DIR, detect=True)
    assert inside["origin"] == os.path.join(SITE_DIR, "deepspeed", "__init__.py")
    assert inside["version"] == "0.19.8+rayzero"
    assert inside["detected"] == [True, True, True]  # transformers, accelerate, accelerate's version gate
    assert inside["engine"] == "rayzero.compat.engine"
    assert inside["schedules"] == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    outside = _probe()
    assert outside["origin"] is None or not outside["origin"].startswith(SITE_DIR)
    if outside["origin"] is not None:  # the bench extra's real DeepSpeed: still itself
        assert "+rayzero" not in outside["version"]


@pytest.fixture
def compat_deepspeed():
    """The compat `deepspeed` package imported in this process, and every `deepspeed` module this
    process had before (a real DeepSpeed another test imported) put back afterwards."""
    saved = {name: module for name, module in sys.modules.items() if name == "deepspeed" or name.startswith("deepspeed.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, SITE_DIR)
    try:
        import deepspeed

        yield deepspeed
    finally:
        sys.path.remove(SITE_DIR)
        for name in [name for name in sys.modules if name == "deepspeed" or name.startswith("deepspeed.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_refused_names_say_which_deepspeed_name_and_why(compat_deepspeed):
    deepspeed = compat_deepspeed
    from deepspeed.runtime.zero import Init

    assert deepspeed.__file__.startswith(SITE_DIR)
    with pytest.raises(DeepSpeedNameRefused, match=r"deepspeed\.tp_model_init .*data parallel"):
        deepspeed.tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32)
    with pytest.raises(DeepSpeedNameRefused, match=r"deepspeed\.utils\.groups\._get_sequence_parallel_group"):
        deepspeed.utils.groups._get_sequence_parallel_group()
    with pytest.raises(DeepSpeedNameRefused, match=r"zero\.Init\(mpu=\.\.\.\)"):
        Init(mpu=object())
    with pytest.raises(DeepSpeedNameRefused, match="set_z3_leaf_modules"):
        deepspeed.utils.set_z3_leaf_modules(torch.nn.Linear(2, 2), [torch.nn.Linear])
    assert issubclass(DeepSpeedNameRefused, RayZeroError)


def test_the_cpu_accelerator_answers_for_the_processes_on_this_node(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU accelerator is what a machine without CUDA gets")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    accelerator = RayZeroAccelerator()
    assert (accelerator.device_name(), accelerator.current_device_name(), accelerator.current_device()) == ("cpu", "cpu", 2)
    assert accelerator.communication_backend_name() == "gloo"
    assert accelerator.device_count() == 3
    assert accelerator.is_available() and accelerator.on_accelerator(torch.zeros(1))
    pinned = torch.ones(2)
    assert accelerator.pin_memory(pinned) is pinned  # CPU-only torch cannot pin; DeepSpeed's CPU accelerator neither
    with pytest.raises(DeepSpeedNameRefused, match=r"get_accelerator\(\)\.create_op_builder"):
        accelerator.create_op_builder("CPUAdamBuilder")


def _steps(optimizer_class: type, **kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = optimizer_class([weight], lr=1e-2, weight_decay=0.1, **kwargs)
    for _ in range(3):
        optimizer.zero_grad()
        (weight.sin().sum() + weight.square().mean()).backward()
        optimizer.step()
    return weight.detach()


def test_deepspeed_adam_classes_are_torch_adam_with_deepspeed_defaults():
    # adamw_mode (DeepSpeed's default) decouples weight decay: torch's AdamW; off, L2 in the gradient: torch's Adam
    torch.testing.assert_close(_steps(DeepSpeedCPUAdam), _steps(torch.optim.AdamW), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_steps(DeepSpeedCPUAdam, adamw_mode=False), _steps(torch.optim.Adam),
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_steps(FusedAdam), _steps(torch.optim.AdamW), rtol=1e-6, atol=1e-7)
    assert DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))]).defaults["weight_decay"] == 0  # not torch's 0.01
    with pytest.raises(DeepSpeedNameRefused, match=r"bias_correction=False"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], bias_correction=False)


def test_clone_for_saving_copies_each_tensor_once_so_ties_survive():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    state = clone_tensors_for_torch_save(model.state_dict())
    assert state["0.weight"] is state["1.weight"]
    assert state["0.weight"].untyped_storage().data_ptr() != model[0].weight.untyped_storage().data_ptr()
    assert torch.equal(state["0.weight"], model[0].weight)
    nested = clone_tensors_for_torch_save({"a": [torch.ones(2)], "b": (torch.zeros(1), 3)})
    assert torch.equal(nested["a"][0], torch.ones(2)) and nested["b"][1] == 3


def test_the_trainer_is_wrapped_even_when_transformers_loads_after_deepspeed():
    """A script that imports deepspeed first: the Trainer's train() is wrapped when transformers'
    trainer module loads ([Note: the Trainer in a rayzero run]); nothing else is touched."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import deepspeed, transformers.trainer_utils; "
            "assert 'transformers.trainer' not in sys.modules; from transformers import Trainer, TrainingArguments; "
            "print('WRAPPED', getattr(Trainer.train, '__rayzero_wrapped__', False), Trainer.train.__name__, "
            "hasattr(TrainingArguments, '__rayzero_wrapped__'))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code, SITE_DIR], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "WRAPPED True train False" in done.stdout

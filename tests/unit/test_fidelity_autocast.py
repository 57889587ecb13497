"""The pieces of `torch_autocast` ([Note: torch_autocast] in rayzero/engine/autocast.py) held to their
references: the float16 loss scale to torch.amp.GradScaler itself, which parameters communicate in
the lower precision to DeepSpeed 0.19.8's own `init_autocast_params`, and an outer autocast region to
DeepSpeed's `autocast_if_enabled`. The trained result is compared with DeepSpeed in
tests/dist/test_fidelity_torch_autocast.py."""
from __future__ import annotations

import warnings

import pytest
import torch

from rayzero.config import load_config
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.autocast import build_autocast_policy, forward_region
from rayzero.engine.loss_scaler import GradScalerLossScaler

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_float16_loss_scale_follows_torch_grad_scaler():
    """Same overflow pattern into torch's GradScaler and rayzero's: the same scale after every step."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    theirs = torch.amp.GradScaler("cpu", growth_interval=3)
    ours = GradScalerLossScaler(growth_interval=3)
    theirs.scale(torch.ones(()))  # GradScaler creates its scale on first use
    assert ours.loss_scale == theirs.get_scale() == 2.0**16
    overflows = [False, False, False, True, False, True, True, False, False, False, False, False, False]
    for overflow in overflows:
        param.grad = torch.tensor([float("inf") if overflow else 1.0])
        theirs.step(optimizer)  # unscales (finds the inf) and skips the step on overflow
        theirs.update()
        ours.update_scale(overflow)
        assert ours.loss_scale == theirs.get_scale()
    restored = GradScalerLossScaler(growth_interval=3)
    restored.load_state_dict(ours.state_dict())
    assert restored.state_dict() == ours.state_dict()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.conv = torch.nn.Conv1d(4, 4, 1)
        self.norm = torch.nn.LayerNorm(4)
        self.embed = torch.nn.Embedding(5, 4)
        self.subclassed = type("MyLinear", (torch.nn.Linear,), {})(4, 4)


def _deepspeed_marked(net: torch.nn.Module, modules: list[str] | None) -> set[str]:
    """The parameters DeepSpeed's own init_autocast_params gives a communication dtype."""
    autocast = pytest.importorskip("deepspeed.runtime.torch_autocast")

    class Engine:
        module = net

        @staticmethod
        def zero_quantized_weights() -> bool:
            return False

    names = modules if modules is not None else autocast.get_default_autocast_lower_precision_modules()
    autocast.init_autocast_params(Engine, torch.bfloat16, names)
    marked = {name for name, param in net.named_parameters() if autocast.has_comm_dtype(param)}
    for param in net.parameters():  # DeepSpeed marks the parameters themselves: undo for the next case
        if autocast.has_comm_dtype(param):
            delattr(param, autocast.PARAM_COMM_DTYPE_ATTR_NAME)
    return marked


@pytest.mark.parametrize("modules", [None, ["torch.nn.LayerNorm", "torch.nn.modules.sparse.Embedding"]])
def test_lower_precision_parameters_are_deepspeeds(modules):
    net = _Net()
    section = {"enabled": True, "dtype": "bf16"}
    if modules is not None:
        section["lower_precision_safe_modules"] = modules
    policy = build_autocast_policy(load_config({"torch_autocast": section}).torch_autocast, net, CPU)
    ours = {name for name, param in net.named_parameters() if id(param) in policy.lower_precision_params}
    assert ours == _deepspeed_marked(net, modules)
    assert all(not name.startswith("subclassed") for name in ours), "an exact class match, as DeepSpeed"
    assert policy.dtype == torch.bfloat16


def test_dtype_defaults_to_torchs_autocast_default_and_fp32_means_none():
    net = _Net()
    unset = load_config({"torch_autocast": {"enabled": True}}).torch_autocast
    assert build_autocast_policy(unset, net, CPU).dtype == torch.get_autocast_dtype("cpu")
    fp32 = load_config({"torch_autocast": {"enabled": True, "dtype": "float32"}})
    assert build_autocast_policy(fp32.torch_autocast, net, CPU) is None
    assert any("torch_autocast" in note and "float32" in note for note in fp32.notes)
    disabled = load_config({"torch_autocast": {"enabled": False}}).torch_autocast
    assert build_autocast_policy(disabled, net, CPU) is None


def test_a_module_that_does_not_import_is_named():
    section = load_config({"torch_autocast": {"enabled": True,
                                              "lower_precision_safe_modules": ["nope.Linear"]}})
    with pytest.raises(RayZeroValueError, match="lower_precision_safe_modules.*nope.Linear"):
        build_autocast_policy(section.torch_autocast, _Net(), CPU)


def test_an_unknown_dtype_is_refused_at_load_as_deepspeed_refuses_it():
    from rayzero.config import ConfigError

    with pytest.raises(ConfigError, match="torch_autocast.dtype"):
        load_config({"torch_autocast": {"enabled": True, "dtype": "bfloat"}})


def test_an_outer_autocast_is_off_inside_the_engine_without_torch_autocast_and_on_with_it():
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    section = load_config({"torch_autocast": {"enabled": True, "dtype": "bf16"}}).torch_autocast
    policy = build_autocast_policy(section, linear, CPU)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with forward_region(None, "cpu"):
                assert linear(x).dtype == torch.float32
        assert any("torch_autocast" in str(w.message) for w in caught)
        with forward_region(policy, "cpu"):
            assert linear(x).dtype == torch.bfloat16
    with forward_region(policy, "cpu"):
        assert linear(x).dtype == torch.bfloat16
    with forward_region(None, "cpu"):
        assert linear(x).dtype == torch.float32

"""[Note: the config package loads its models on first use]: a process that never reads a config (a
run's NodeRelay actors, one per node per attempt) does not import the pydantic models and the loader,
and every public name of rayzero.config still imports as before."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def _modules_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(done.stdout.split())


def test_a_relay_and_the_errors_import_without_the_config_models():
    for statement in ("import rayzero.workers.relay", "from rayzero.config import ConfigError, RayZeroError"):
        loaded = _modules_after(statement)
        assert not {"rayzero.config.loader", "rayzero.config.model"} & loaded, statement


def test_every_public_name_still_imports_and_is_the_defining_modules():
    from rayzero import config
    from rayzero.config.loader import load_config
    from rayzero.config.model import RayZeroConfig

    for name in config.__all__:
        assert getattr(config, name) is not None
        assert name in dir(config)
    assert config.load_config is load_config and config.RayZeroConfig is RayZeroConfig
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        config.not_a_name  # noqa: B018 - the attribute access is the test
    loaded = _modules_after("from rayzero.config import *")
    assert "rayzero.config.loader" in loaded

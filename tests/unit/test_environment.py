"""The environment-variable registry (rayzero/config/environment.py, [Note: environment variables]):
every RAYZERO_* name the code uses is declared once, docs/environment.md is what the declarations
generate, values parse or fail naming the variable, and a renamed variable's old name still works
for a release, with a warning naming the new one."""
from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from rayzero.config import environment
from rayzero.config.environment import (
    ATTEMPT,
    COLLECTIVE_TIMEOUT_S,
    DURABLE_URI,
    OFFLOAD_OVERLAP_STEP,
    OPERATOR_RESYNC_S,
    RUN,
    EnvironmentValueError,
    Role,
    RunHandoff,
    declared,
)
from rayzero.config.environment_docs import main as environment_docs_main
from rayzero.config.environment_docs import render

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [path for base in ("rayzero", "operators") for path in (ROOT / base).rglob("*.py")
           if path.name != "environment.py" and "control_api/v1" not in path.as_posix()]


def test_every_rayzero_variable_in_the_code_is_declared_once():
    names = [variable.name for variable in declared()]
    assert len(names) == len(set(names)), "a variable is declared twice"
    known = set(names) | {old for variable in declared() for old in variable.deprecated_names}
    used = {match for path in SOURCES for match in re.findall(r"RAYZERO_[A-Z0-9_]*[A-Z0-9]", path.read_text())}
    # RAYZERO_CONTROL_TLS_ and the like are prefixes in prose, not variables
    undeclared = {name for name in used - known if not any(other.startswith(name + "_") for other in known)}
    assert not undeclared, f"declare these in rayzero/config/environment.py: {sorted(undeclared)}"


def test_no_module_reads_a_rayzero_variable_by_name():
    """Reads go through the declarations, so defaults and parsing live in one place."""
    pattern = re.compile(r"""environ(?:\.get\(|\[|\.pop\(|\.setdefault\()\s*["']RAYZERO_""")
    offenders = [str(path.relative_to(ROOT)) for path in SOURCES if pattern.search(path.read_text())]
    assert not offenders


def test_every_declared_variable_is_read_somewhere():
    """What nothing reads is not declared (RAYZERO_JOB_NAME was set for years and never read)."""
    text = "\n".join(path.read_text() for path in SOURCES)
    attributes = {name: value for name, value in vars(environment).items() if isinstance(value, environment.Variable)}
    unread = [name for name in attributes if not re.search(rf"\b{name}\b", text)]
    assert not unread


def test_docs_environment_md_is_generated_from_the_declarations(tmp_path):
    assert (ROOT / "docs" / "environment.md").read_text() == render(), \
        "run: python -m rayzero.config.environment_docs --write docs/environment.md"
    text = render()
    for variable in declared():
        assert f"`{variable.name}`" in text
    internal = text.split("## Internal", 1)[1]
    assert "`RAYZERO_RUN`" in internal and "`RAYZERO_RUN`" not in text.split("## Internal", 1)[0]
    stale = tmp_path / "environment.md"
    stale.write_text(text.replace("Overrides", "Sets"))
    assert environment_docs_main(["--check", str(stale)]) == 1
    assert environment_docs_main(["--check", str(ROOT / "docs" / "environment.md")]) == 0


def test_values_parse_with_their_defaults_and_bad_ones_name_the_variable():
    assert COLLECTIVE_TIMEOUT_S.get({}) == 300.0
    assert COLLECTIVE_TIMEOUT_S.get({"RAYZERO_COLLECTIVE_TIMEOUT_S": "12.5"}) == 12.5
    assert COLLECTIVE_TIMEOUT_S.get({"RAYZERO_COLLECTIVE_TIMEOUT_S": "  "}) == 300.0  # blank is unset
    assert ATTEMPT.get({"RAYZERO_ATTEMPT": "2"}) == 2
    assert OFFLOAD_OVERLAP_STEP.get({"RAYZERO_OFFLOAD_OVERLAP_STEP": " 1 "}) == "1"
    assert DURABLE_URI.is_set({"RAYZERO_DURABLE_URI": ""}) and DURABLE_URI.get({"RAYZERO_DURABLE_URI": ""}) is None
    with pytest.raises(EnvironmentValueError, match=r"RAYZERO_COLLECTIVE_TIMEOUT_S='soon': use seconds"):
        COLLECTIVE_TIMEOUT_S.get({"RAYZERO_COLLECTIVE_TIMEOUT_S": "soon"})
    with pytest.raises(ValueError, match="RAYZERO_OFFLOAD_OVERLAP_STEP='sometimes': use auto, 1 or 0"):
        OFFLOAD_OVERLAP_STEP.get({"RAYZERO_OFFLOAD_OVERLAP_STEP": "sometimes"})


def test_a_renamed_variable_is_read_under_its_old_name_with_a_warning_naming_the_new_one():
    with pytest.warns(FutureWarning, match="RAYZERO_OPERATOR_RESYNC_SECONDS is deprecated.*RAYZERO_OPERATOR_RESYNC_S"):
        assert OPERATOR_RESYNC_S.get({"RAYZERO_OPERATOR_RESYNC_SECONDS": "7"}) == 7.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name wins, silently
        both = {"RAYZERO_OPERATOR_RESYNC_S": "3", "RAYZERO_OPERATOR_RESYNC_SECONDS": "7"}
        assert OPERATOR_RESYNC_S.get(both) == 3.0
    assert all(variable.name.endswith("_S") for variable in declared() if variable.type.startswith("seconds"))


def test_the_run_handoff_travels_as_one_variable():
    handoff = RunHandoff(name="exp", storage="file:///runs/exp", resuming=True, node_local_checkpoints=True,
                         trainer={"learning_rate": 3e-5}, notes_shown=("note a",))
    assert RUN.get({"RAYZERO_RUN": handoff.to_text()}) == handoff
    assert RUN.get({}) == RunHandoff() and RunHandoff().notes_shown is None  # outside rayzero.fit
    with pytest.raises(EnvironmentValueError, match="RAYZERO_RUN"):
        RUN.get({"RAYZERO_RUN": '{"name": "exp", "colour": "red"}'})
    assert RUN.role is Role.INTERNAL


def test_the_operator_reads_a_deprecated_name_at_start_up():
    """The operator's timings are read when its modules load (kopf's timers take them)."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import rayzero_operator.handlers as h, rayzero_operator.control as c\n"
            "print(h.RESYNC_SECONDS, c.REFRESH_S)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{ROOT / 'operators'}",
           "RAYZERO_OPERATOR_RESYNC_SECONDS": "9", "RAYZERO_OPERATOR_CONTROL_REFRESH_S": "2"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["9.0", "2.0"]
    assert "set RAYZERO_OPERATOR_RESYNC_S instead" in done.stderr

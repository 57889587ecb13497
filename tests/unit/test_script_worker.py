"""The worker's side of a script run, without Ray: a real script run as `__main__` by `run_script`
in a fresh process (its fd 1/2 are redirected, so not in pytest's), its exit status, its rank-labelled
output, and the compat seam ([Note: scripts on workers], [Note: rank-prefixed output])."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from rayzero.workers.script import COMPAT_SITE, use_compat_modules

SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys
    print("SEEN " + json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd()}))
    print("to stderr", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "print('from a child process')"], check=True)
    sys.stdout.write("bar 1%\\rbar 2%\\rbar 100%\\n")
    how = sys.argv[1]
    if how == "raise":
        raise ValueError("the script's own error")
    if how == "text":
        sys.exit("a message for the user")
    if how != "return":
        sys.exit(None if how == "none" else int(how))
    """
)

HARNESS = textwrap.dedent(
    """
    import os, sys
    from rayzero.workers.script import ScriptLaunch, run_script
    lines = []
    target, how = sys.argv[1], sys.argv[2]
    launch = ScriptLaunch(target, (how, "--flag", "x y"), False, os.path.abspath(target), target, os.getcwd())
    ended = run_script(launch, 1, on_output=lambda: lines.append(1))
    print(f"ENDED code={ended.code} error={ended.error!r} lines_counted={len(lines)}")
    print("TRACEBACK " + ended.traceback_text.replace(chr(10), " | "))
    """
)


def _run(tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "train.py").write_text(SCRIPT)
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    return subprocess.run([sys.executable, str(harness), "project/train.py", how], cwd=tmp_path, text=True,
                          capture_output=True, timeout=120, check=False)


def test_a_script_runs_as_main_with_torchrun_s_argv_path_and_cwd_and_labelled_output(tmp_path):
    done = _run(tmp_path, "return")
    assert done.returncode == 0, done.stderr
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("[rank 1] SEEN "))
                      .removeprefix("[rank 1] SEEN "))
    assert seen == {"name": "__main__", "argv": ["project/train.py", "return", "--flag", "x y"],
                    "path0": str((tmp_path / "project").resolve()), "cwd": str(tmp_path)}
    assert "[rank 1] from a child process" in done.stdout.splitlines()  # the child's fd 1 is the pipe too
    assert "[rank 1] to stderr" in done.stderr.splitlines()  # stderr stays stderr
    bar = [line for line in done.stdout.splitlines() if "bar" in line]
    assert bar[0] == "[rank 1] bar 1%" and bar[-1] == "[rank 1] bar 100%" and "[rank 1] bar 2%" not in bar  # redraws
    assert "ENDED code=0 error=None" in done.stdout
    assert int(done.stdout.split("lines_counted=")[1].split()[0]) >= 5  # every line was progress


def test_exit_statuses_are_python_s(tmp_path):
    expected = {"3": "code=3 error='SystemExit: 3'", "0": "code=0 error=None", "none": "code=0 error=None",
                "text": "code=1 error='SystemExit: a message for the user'"}
    for how, ending in expected.items():
        done = _run(tmp_path, how)
        assert f"ENDED {ending}" in done.stdout, (how, done.stdout, done.stderr)
    assert "[rank 1] a message for the user" in done.stderr.splitlines()  # printed, as the interpreter does


def test_an_exception_is_status_1_with_the_script_s_traceback_on_stderr(tmp_path):
    done = _run(tmp_path, "raise")
    assert "ENDED code=1 error=\"ValueError: the script's own error\"" in done.stdout
    traceback = done.stdout.split("TRACEBACK ")[1]
    assert "project/train.py\", line 9, in <module>" in traceback
    assert "runpy" not in traceback and "rayzero/workers" not in traceback  # from the script's frame on
    assert "[rank 1] ValueError: the script's own error" in done.stderr.splitlines()


def test_the_compat_seam_puts_its_directory_first_and_changes_nothing_when_it_is_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    environ = {"PYTHONPATH": f"/somewhere{os.pathsep}{tmp_path}"}
    assert use_compat_modules(tmp_path / "absent", environ) is False
    assert environ == {"PYTHONPATH": f"/somewhere{os.pathsep}{tmp_path}"} and str(tmp_path / "absent") not in sys.path
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("WHO = 'rayzero compat'\n")
    assert use_compat_modules(tmp_path, environ) is True
    assert sys.path[0] == str(tmp_path)
    assert environ["PYTHONPATH"] == f"{tmp_path}{os.pathsep}/somewhere"  # first, and once
    # a child process started with that PYTHONPATH imports the directory's module
    child = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.WHO)"], text=True,
                           capture_output=True, env=dict(os.environ, **environ), check=True, timeout=60)
    assert child.stdout.strip() == "rayzero compat"
    assert COMPAT_SITE == Path(__file__).resolve().parents[2] / "rayzero" / "compat" / "site"

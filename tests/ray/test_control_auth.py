"""What the operator generates relies on Ray's token authentication (RAY_AUTH_MODE=token with the
job Secret's token): a Ray head started that way refuses job-API requests without the token, as the
control service refuses calls without its own (tests/unit/test_control_server.py)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.error
import urllib.request

from rayzero.ports import server_port

HEAD = textwrap.dedent(
    """
    import sys
    import ray

    from rayzero.driver.startup import start_retrying

    # started afresh while it misses Ray's start-up bounds on a loaded machine, as rayzero's own local Ray is
    start_retrying(lambda: ray.init(address="local", num_cpus=1, include_dashboard=True, dashboard_host="127.0.0.1",
                                    dashboard_port=int(sys.argv[1]), logging_level="ERROR"),
                   "the test's Ray head", 3, tag="[tests]")
    print("READY", flush=True)
    sys.stdin.read()  # until the test closes it
    ray.shutdown()
    """
)


def _get(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            json.loads(answer.read() or b"null")
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_token_mode_ray_head_refuses_the_job_api_without_the_token(tmp_path):
    token = secrets.token_urlsafe(32)
    port = server_port()  # bound by the head's dashboard later: [Note: ports below the ephemeral range]
    short = tempfile.mkdtemp(prefix="rzauth", dir="/tmp")  # Ray's socket paths must stay < 108 bytes
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "RAY_TMPDIR": short, "HOME": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen([sys.executable, "-c", HEAD, str(port)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in head.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        assert lines and lines[-1].startswith("READY"), "".join(lines)
        url = f"http://127.0.0.1:{port}/api/jobs/"
        assert _get(url, None) in (401, 403)
        assert _get(url, "not-the-token") in (401, 403)
        assert _get(url, token) == 200
    finally:
        head.stdin.close()
        head.wait(60)
        shutil.rmtree(short, ignore_errors=True)

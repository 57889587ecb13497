"""A real kube-apiserver 1.20 + etcd on loopback, for the k8s tests (no kubelet, no controllers).

    python scripts/k8s_envtest.py up     # start one, print a KUBECONFIG line, stop on Ctrl-C

`scripts/k8s_envtest_build.sh` builds the apiserver once from Debian's Kubernetes source and caches
it under ~/.cache/rayzero (see tests/k8s/README.md); `EnvTest.start()` runs it if the binary is
missing. Every port is chosen free, everything binds 127.0.0.1, and `stop()` ends only the two
processes it started. Authentication: a static admin token (group system:masters) and ServiceAccount
tokens (TokenRequest API, signed with a key made here); authorization: RBAC, so a ServiceAccount
token is held to exactly its roles.
"""
from __future__ import annotations

import base64
import json
import os
import pathlib
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from rayzero.ports import free_port, server_port

SCRIPTS = pathlib.Path(__file__).resolve().parent
CACHE = pathlib.Path(os.environ.get("RAYZERO_CACHE", pathlib.Path.home() / ".cache" / "rayzero"))
APISERVER = CACHE / "kube-apiserver-1.20.2"
BUILD_SCRIPT = SCRIPTS / "k8s_envtest_build.sh"


def ensure_binaries() -> None:
    """Build and cache the apiserver (and install etcd) unless already there: ~5 min once."""
    if not (APISERVER.exists() and shutil.which("etcd") and shutil.which("openssl")):
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)


class EnvTest:
    """One etcd + kube-apiserver pair in a temporary directory."""

    def __init__(self) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="rayzero-envtest-"))
        self.admin_token = secrets.token_hex(16)
        self.port = 0
        self.processes: list[subprocess.Popen] = []
        self.ca_file = self.dir / "apiserver.crt"
        self.admin_kubeconfig = self.dir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 (the child process keeps it)
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(process)
        return process

    def _certificates(self) -> None:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-keyout", str(self.dir / "apiserver.key"), "-out", str(self.ca_file),
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
            check=True, capture_output=True)
        subprocess.run(["openssl", "genrsa", "-out", str(self.dir / "sa.key"), "2048"],
                       check=True, capture_output=True)
        (self.dir / "tokens.csv").write_text(f'{self.admin_token},admin,admin-uid,"system:masters"\n')

    def start(self, timeout: float = 60.0) -> EnvTest:
        ensure_binaries()
        self._certificates()
        # the apiserver's port is given up for a moment by `restart_apiserver`: from below the ephemeral
        # range, so no connection takes it meanwhile ([Note: ports below the ephemeral range])
        etcd_port, peer_port, self.port = free_port(), free_port(), server_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", [
            "etcd", "--data-dir", str(self.dir / "etcd"), "--listen-client-urls", etcd_url,
            "--advertise-client-urls", etcd_url, "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync",  # test data: durability is not worth the fsyncs on a shared disk
        ])
        sa_key = str(self.dir / "sa.key")
        self._apiserver_argv = [
            str(APISERVER), "--etcd-servers", etcd_url, "--bind-address=127.0.0.1",
            f"--secure-port={self.port}", f"--tls-cert-file={self.ca_file}",
            f"--tls-private-key-file={self.dir / 'apiserver.key'}",
            f"--token-auth-file={self.dir / 'tokens.csv'}", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa_key}", f"--service-account-signing-key-file={sa_key}",
            "--api-audiences=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.0.0.0/24", "--disable-admission-plugins=ServiceAccount",
            "--cert-dir", str(self.dir / "certs"), "--logtostderr=true", "--v=0",
        ]
        self._apiserver = self._spawn("kube-apiserver", self._apiserver_argv)
        self._wait_ready(timeout)
        self.admin_kubeconfig.write_text(self.kubeconfig(self.admin_token, "admin"))
        self._ensure_namespace("default")
        return self

    def restart_apiserver(self, down_seconds: float = 1.0, timeout: float = 60.0) -> None:
        """Kill the apiserver (etcd keeps the data), wait, start it again on the same port."""
        self._apiserver.kill()  # a graceful stop waits out open watches for a minute
        self._apiserver.wait(timeout=30)
        self.processes.remove(self._apiserver)
        time.sleep(down_seconds)
        self._apiserver = self._spawn("kube-apiserver", self._apiserver_argv)
        self._wait_ready(timeout)

    def _request(self, method: str, path: str, body: dict | None = None,
                 token: str | None = None) -> dict:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        request = urllib.request.Request(
            self.server + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token or self.admin_token}",
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return json.loads(response.read() or b"{}")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{self.logs()}")
            try:
                context = ssl.create_default_context(cafile=str(self.ca_file))
                request = urllib.request.Request(self.server + "/readyz",
                                                 headers={"Authorization": f"Bearer {self.admin_token}"})
                with urllib.request.urlopen(request, context=context, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError) as error:
                last = error
            time.sleep(0.2)
        raise TimeoutError(f"kube-apiserver not ready after {timeout}s ({last}):\n{self.logs()}")

    def _ensure_namespace(self, name: str) -> None:
        # No controller-manager: nothing creates `default` for us.
        try:
            self._request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                         "metadata": {"name": name}})
        except urllib.error.HTTPError as error:
            if error.code != 409:
                raise

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A token for an existing ServiceAccount, minted through the TokenRequest API."""
        answer = self._request(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": seconds}})
        return answer["status"]["token"]

    def kubeconfig(self, token: str, user: str) -> str:
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "envtest",
            "clusters": [{"name": "envtest", "cluster": {"server": self.server,
                                                         "certificate-authority-data": ca}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": user}}],
        })

    def write_kubeconfig(self, token: str, user: str) -> pathlib.Path:
        path = self.dir / f"{user.replace(':', '_')}.kubeconfig"
        path.write_text(self.kubeconfig(token, user))
        return path

    def logs(self, lines: int = 40) -> str:
        out = []
        for name in ("etcd", "kube-apiserver"):
            path = self.dir / f"{name}.log"
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self) -> None:
        for process in reversed(self.processes):  # apiserver first, then etcd
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv[:1] != ["up"]:
        print(__doc__)
        return 2
    env = EnvTest().start()
    print(f"export KUBECONFIG={env.admin_kubeconfig}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        env.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

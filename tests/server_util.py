"""Start a real `conveyor serve` process on 127.0.0.1 for tests."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

# The tests' requests in a row go through one client: httpx.get/post build a new client per
# call, and its SSL context (~40 ms) was most of each of the hardening fuzz table's ~600 round
# trips.
HTTP = httpx.Client(timeout=60)


def post(
    base_url: str,
    path: str,
    body=None,
    raw: bytes | str | None = None,
    key: str | None = None,
    timeout: float = 60,
) -> httpx.Response:
    """POST `body` as JSON, or `raw` bytes labelled as JSON (malformed bodies), with a bearer key
    when one is given."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return HTTP.post(f"{base_url}{path}", content=raw, headers=headers, timeout=timeout)
    return HTTP.post(f"{base_url}{path}", json=body, headers=headers, timeout=timeout)


def trusting(cert: str | Path) -> ssl.SSLContext:
    """A client's TLS context that trusts the server certificate `cert` (self-signed)."""
    return ssl.create_default_context(cafile=str(cert))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    # free_port's port is free when it returns, not when the server binds it: a test running in
    # parallel may take it in between. Such a start is retried on another port.
    BIND_ATTEMPTS = 3

    def __init__(
        self, args: list[str], log_path: Path, timeout: float = 240.0, log_level: str = "warning"
    ) -> None:
        self.api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.log_path, self.log_level = log_path, log_level
        # HTTPS (--ssl-certfile): probed with a client that trusts that certificate.
        cert = args[args.index("--ssl-certfile") + 1] if "--ssl-certfile" in args else None
        self.scheme = "http" if cert is None else "https"
        self.client = HTTP if cert is None else httpx.Client(timeout=60, verify=trusting(cert))
        for attempt in range(self.BIND_ATTEMPTS):
            self._start(args)
            try:
                self._wait_ready(timeout)
                return
            except RuntimeError:
                taken = "address already in use" in log_path.read_text()
                if not taken or attempt == self.BIND_ATTEMPTS - 1:
                    raise
                self.stop()

    def _start(self, args: list[str]) -> None:
        self.port = free_port()
        self.base_url = f"{self.scheme}://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "conveyor.cli",
            "serve",
            *args,
            "--port",
            str(self.port),
            "--log-level",
            self.log_level,
        ]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if self.client.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.log_path.read_text()[-3000:]}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Sample name -> value summed over labels, and "name{label=value,...}" -> value, parsed
        with prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        response = self.client.get(f"{self.base_url}/metrics", headers=self.headers, timeout=10)
        response.raise_for_status()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}"] = sample.value
        return values

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class InThreadServer:
    """`conveyor serve`'s app (build_app: every route, parser and middleware it serves) over an
    engine built in this process, served by uvicorn on 127.0.0.1 from a thread. For the
    modules that start a server per parser family: a process apiece (torch's import, the
    engine's start) cost ~4 s of CPU each. What only the command line does (parsing its
    flags, the engine-core process) is tested through ServerProcess."""

    def __init__(
        self, model: str | Path, name: str = "tiny", parsers=None, **engine_settings
    ) -> None:
        from conveyor import LLMEngine
        from conveyor.entrypoints.openai.api_server import build_app

        engine_settings = {"dtype": "float32", "kv_cache_memory": "32MiB"} | engine_settings
        self.engine = LLMEngine(str(model), **engine_settings)
        app = build_app(self.engine, name, parsers=parsers)
        for _ in range(ServerProcess.BIND_ATTEMPTS):  # a port taken meanwhile: another one
            self.port = free_port()
            self.base_url = f"http://127.0.0.1:{self.port}"
            config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
            self.server = uvicorn.Server(config)
            self.thread = threading.Thread(target=self.server.run, daemon=True)
            self.thread.start()
            deadline = time.monotonic() + 60
            while not self.server.started and self.thread.is_alive():
                if time.monotonic() > deadline:
                    raise RuntimeError("the in-thread server did not start in 60 s")
                time.sleep(0.02)
            if self.server.started:
                return
        raise RuntimeError(f"no free port in {ServerProcess.BIND_ATTEMPTS} attempts")

    def stop(self) -> None:
        """Stops the server, then its engine: the thread count its governor took goes back
        to this process (a later test in this worker sees torch's threads as they were)."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()


# ---- the processes behind a server (engine core, ranks) -----------------------------------


def start_tiny(tiny_checkpoint, tmp_path: Path, *extra: str, model: str = "tiny") -> ServerProcess:
    """A server of the tiny random llama in float32, served as `model`."""
    args = [str(tiny_checkpoint("llama")), "--dtype", "float32", "--served-model-name", model]
    return ServerProcess([*args, *extra], tmp_path / "server.log")


def children(pid: int) -> list[int]:
    """Live processes whose parent is pid (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> set[int]:
    """Live processes under pid, at any depth (from /proc): a server's Ray actors are children
    of the raylet it started, and a machine-wide pgrep would also see another test's."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def core_pid(server: ServerProcess) -> int:
    """The engine-core process."""
    pids = [
        pid
        for pid in children(server.proc.pid)
        if b"conveyor.engine.core_proc" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(pids) == 1, f"expected one engine-core process, found {pids}"
    return pids[0]


def core_pid_or_none(server: ServerProcess) -> int | None:
    try:
        return core_pid(server)
    except AssertionError:
        return None


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"

"""A real `bert-port-serve` process on a free port of this machine, for the server's tests:
started with the command users run, waited for on /health with a deadline, stopped with SIGTERM
(then SIGKILL past a deadline), its log kept for the failure message."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

STARTUP_S = 180.0  # loading and warming on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model, *flags: str, env: dict | None = None, wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="bert-port-serve-")  # noqa: SIM115 -- closed in __exit__
        command = [sys.executable, "-m", "bert_port.cli.serve", str(model), "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        if wait:
            self.wait_ready()

    def wait_ready(self, deadline_s: float = STARTUP_S) -> list[int]:
        """Poll /health until 200; the status codes seen on the way."""
        seen, end = [], time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                code = httpx.get(self.url + "/health", timeout=5).status_code
                seen.append(code)
                if code == 200:
                    return seen
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"the server was not ready within {deadline_s:g} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def metric(self, name: str, headers: dict | None = None) -> float:
        """The sum of a Prometheus sample's values over its labels (0 when absent)."""
        response = httpx.get(self.url + "/metrics", timeout=10, headers=headers or {})
        response.raise_for_status()
        text = response.text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        self.log.close()

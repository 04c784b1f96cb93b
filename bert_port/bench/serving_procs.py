"""The servers the serving bench measures, each in a process of its own: how to start one
(`ServerSpec`), on a free port of 127.0.0.1, with the thread budget, offline and with
telemetry off; waiting for it with a deadline; stopping it (SIGTERM, then SIGKILL) whatever
happened; and the separate virtual environment infinity-emb needs.

infinity-emb 0.0.78 pins transformers 4.x while this project needs 5.x, so it lives in a venv
of its own (`.venv-infinity`, `setup_infinity`), built from the same CPU torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

INFINITY_VERSION = "0.0.78"
TORCH_VERSION = "2.13.0"  # the CPU build this machine's package index holds; never a CUDA build
INFINITY_BATCH = 32  # infinity's own default, and the largest request the bench sends

# Every server: offline (the model is a local folder), no usage statistics sent anywhere.
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "INFINITY_ANONYMOUS_USAGE_STATS": "0",  # infinity's posthog client (infinity_emb/telemetry.py)
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass
class ServerSpec:
    """One server of the bench: `argv(port)` starts it; `health` answers 200 once it is ready;
    `route` takes OpenAI's embeddings body."""

    name: str
    argv: list[str]
    route: str = "/v1/embeddings"
    health: str = "/health"
    env: dict[str, str] = field(default_factory=dict)

    def command(self, port: int) -> list[str]:
        return [a.replace("{port}", str(port)) for a in self.argv]


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_env(threads: int) -> dict[str, str]:
    """The thread budget as the math libraries read it; each server also gets its own flag."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def port_spec(model_dir: Path, threads: int, quantization: str | None = None) -> ServerSpec:
    """`bert-port-serve` (the console script beside this Python, else its module)."""
    script = Path(sys.executable).with_name("bert-port-serve")
    if script.exists():
        head = [str(script)]
    else:
        head = [sys.executable, "-c", "import sys; from bert_port.cli.serve import main; sys.exit(main())"]
    argv = [*head, str(model_dir), "--host", "127.0.0.1", "--port", "{port}", "--threads", str(threads)]
    if quantization:
        argv += ["--quantization", quantization]
    return ServerSpec("bert-port-serve" + (f" {quantization}" if quantization else " fp32"), argv)


def st_spec(model_dir: Path, threads: int) -> ServerSpec:
    """`SentenceTransformer` behind the minimal one-request-at-a-time app (`st_server`)."""
    argv = [sys.executable, "-m", "bert_port.bench.st_server", str(model_dir), "--port", "{port}"]
    return ServerSpec("sentence-transformers (FastAPI)", [*argv, "--threads", str(threads)])


def infinity_spec(model_dir: Path, venv: Path) -> ServerSpec:
    """infinity-emb's v2 server on the torch engine, fp32 (`--dtype float32`: its `auto` keeps
    the checkpoint's dtype, fp32 here, but says so), dynamic batches of `INFINITY_BATCH`, no
    disk cache of past embeddings (the bench repeats texts) and no torch.compile (its defaults,
    named). It has no thread flag: torch reads OMP_NUM_THREADS at start."""
    argv = [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", str(model_dir), "--engine", "torch"]
    argv += ["--device", "cpu", "--dtype", "float32", "--batch-size", str(INFINITY_BATCH)]
    argv += ["--no-vector-disk-cache", "--no-compile", "--host", "127.0.0.1", "--port", "{port}"]
    return ServerSpec("infinity-emb", argv + ["--log-level", "warning"], route="/embeddings")


def infinity_ready(venv: Path) -> bool:
    return (venv / "bin" / "infinity_emb").exists()


def setup_infinity(venv: Path) -> None:
    """Create `venv` with infinity-emb and the CPU torch, reproducibly: the pinned torch is
    installed first so that infinity's `torch` requirement is already met by the CPU build."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, f"infinity-emb[torch,server]=={INFINITY_VERSION}"], check=True)
    with tempfile.TemporaryDirectory() as tmp:  # infinity_emb may make .infinity_cache in the cwd
        subprocess.run([str(venv / "bin" / "python"), "-c", "import torch, infinity_emb"], check=True, cwd=tmp)


def _get(url: str, timeout: float) -> int:
    import httpx

    try:
        return httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


def _tail(path: Path, chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def wait_ready(process: subprocess.Popen, url: str, deadline_s: float, log_path: Path) -> float:
    """Poll `url` until it answers 200; the seconds it took. Raise if the process exits or
    the deadline passes first, with the end of its log."""
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}:\n{_tail(log_path)}")
        if _get(url, timeout=2.0) == 200:
            return time.monotonic() - start
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer 200 within {deadline_s:.0f} s:\n{_tail(log_path)}")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds the process `pid` (all its threads) has used so far; 0 where
    there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime in ticks


def stop(process: subprocess.Popen, deadline_s: float = 20.0) -> None:
    """SIGTERM to the server's process group (it is a session of its own, started here), then
    SIGKILL if it has not exited within `deadline_s`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(deadline_s)
    except subprocess.TimeoutExpired:
        log.warning("server pid %d ignored SIGTERM for %.0f s: killed", process.pid, deadline_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(deadline_s)


def _exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, `kill`) end this process through its `finally` blocks, so the
    servers it started are stopped too: by default SIGTERM ends Python without running them,
    and a server, a session of its own, would outlive it. Only from the main thread, and only
    where nobody set a handler."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit)


@contextlib.contextmanager
def running(spec: ServerSpec, threads: int, deadline_s: float = 300.0) -> Iterator[tuple[str, int]]:
    """Start `spec` on a free port, wait for its health route, yield its base URL and pid, stop it
    on the way out (on error too). Its output goes to a log in a temporary folder, whose end
    is shown if it fails to start; it also holds infinity's cache folder and the cwd."""
    exit_on_sigterm()
    port = free_port()
    env = {**os.environ, **QUIET_ENV, **thread_env(threads), **spec.env}
    with tempfile.TemporaryDirectory(prefix="bert-port-serving-") as tmp:
        env["INFINITY_HOME"] = tmp  # infinity makes .infinity_cache under it, else under the cwd
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as out:
            process = subprocess.Popen(
                spec.command(port), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True
            )
            try:
                base = f"http://127.0.0.1:{port}"
                took = wait_ready(process, base + spec.health, deadline_s, log_path)
                log.info("%s ready on port %d after %.1f s", spec.name, port, took)
                yield base, process.pid
            finally:
                stop(process)

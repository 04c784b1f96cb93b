"""The peers a user would pick instead of the port for a fast BERT: CTranslate2 (fp32 and
int8), ONNX Runtime and OpenVINO (on a model exported from transformers to ONNX; OpenVINO
fp32 and, where the CPU has native bf16, bf16) and sentence-transformers.

Each builder returns rows (`harness.Row`) whose forward takes a padded batch (the dict
`bert_port.encode` gives) and returns the last hidden state as a (B, T', H) float tensor,
T' <= T (CTranslate2 returns only up to the longest real sequence). A peer that is not installed is left out,
with a line saying which `pip install` brings it; the bench goes on without it.

On the CPU, CTranslate2, ONNX Runtime and OpenVINO each run in a process of their own
(`PeerProcess`, `peer_worker.py` says why); their rows carry a `timed` call for the bench to
time, which leaves the hidden state in that process.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bert_port.extras import MissingExtra, install_hint, require

from . import peer_worker
from .harness import Forward, Row, RowFailed

log = logging.getLogger(__name__)

NAMES = ("input_ids", "attention_mask", "token_type_ids")
WORKER = Path(__file__).with_name("peer_worker.py")
# Seconds a PeerProcess waits for each step's reply: a build may quantize a model (NNCF, 300
# calibration sentences) on a loaded 2-core machine; a run is one batch.
DEADLINES = {"build": 600.0, "run": 300.0, "state": 60.0}


class PeerProcess:
    """`peer_worker.py` in a child process: one CPU peer built and run there, each call
    timed here as a row of the bench (the request and a small reply cross a pipe; the hidden
    state comes back only for the parity pass). Started on the first `build`, ended by
    `stack`, in an environment with the peers' telemetry off (`peer_worker.ENVIRONMENT`).

    Nothing waits on it forever: each request is written, and its reply read, within its
    step's deadline (`DEADLINES`, or the `deadlines` given). A child that misses one is killed;
    that call, a call to a child that died, and every later call to its rows raise `RowFailed`,
    one line that names the row, the step and what happened (a failure the child reports
    raises it too, with the child's traceback): the bench reports the row as failed and goes
    on. A child that does not end within a minute of its input closing is killed."""

    def __init__(self, stack: contextlib.ExitStack, deadlines: dict[str, float] | None = None) -> None:
        self.stack = stack
        self.deadlines = {**DEADLINES, **(deadlines or {})}
        self.process: subprocess.Popen | None = None
        self.failed: str | None = None  # why the child is gone, once it is

    def build(self, name: str, kind: str, options: dict[str, Any]) -> Row:
        if self.process is None:
            self._start()
        self._ask(name, ("build", name, kind, options))

        def forward(batch: dict[str, Tensor]) -> Tensor:
            return torch.from_numpy(self._ask(name, ("run", name, _feeds(batch), True)))

        def timed(batch: dict[str, Tensor]) -> None:  # the same call, the output left there
            self._ask(name, ("run", name, _feeds(batch), False))

        return Row(forward, timed=timed)

    def state(self) -> dict[str, Any]:
        """What the child holds (`peer_worker.state`): its threads, forks, imported modules."""
        return self._ask("peer process", ("state", None))

    def _start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **peer_worker.ENVIRONMENT},
        )
        os.set_blocking(self.process.stdin.fileno(), False)  # written to within a deadline
        self.stack.callback(self.close)

    def _ask(self, name: str, message: tuple) -> Any:
        step = message[0]
        if self.failed:
            raise RowFailed(f"{name}: not run ({step}), its peer process failed earlier: {self.failed}")
        deadline = time.monotonic() + self.deadlines[step]
        try:
            _write(self.process.stdin.fileno(), pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), deadline)
            status, reply = pickle.loads(_read_reply(self.process.stdout.fileno(), deadline))
        except TimeoutError:
            pid = self.process.pid
            self.process.kill()
            self._end()
            self.failed = f"no answer to {step!r} within {self.deadlines[step]:g} s; its process ({pid}) was killed"
            raise RowFailed(f"{name}: {self.failed}") from None
        except (EOFError, BrokenPipeError, pickle.UnpicklingError):
            self.failed = f"the peer process exited with code {self._end()} (its stderr is above)"
            raise RowFailed(f"{name}: {self.failed}") from None
        if status != "ok":  # the child's traceback, its last line first
            raise RowFailed(f"{name}: in the peer process: {reply.strip().splitlines()[-1]}\n{reply}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()  # end of input: the child returns
        self._end()

    def _end(self) -> int:
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.process.stdout.close()
        return code


def _write(fd: int, data: bytes, deadline: float) -> None:
    """All of `data` into the (non-blocking) pipe `fd` by `deadline` (time.monotonic), else
    TimeoutError: a child that reads nothing more cannot hold the bench."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:  # the pipe is full
            _wait(fd, deadline, write=True)


def _read_reply(fd: int, deadline: float) -> memoryview:
    """One reply of the child (its length, then its pickle) from the pipe `fd` by `deadline`,
    else TimeoutError; EOFError where the child closed it first. A small reply comes in one
    read; nothing follows a reply (the child answers one request at a time)."""
    head = peer_worker.REPLY_LENGTH.size
    first = b""
    while len(first) < head:
        _wait(fd, deadline)
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError
        first += chunk
    data = bytearray(head + peer_worker.REPLY_LENGTH.unpack_from(first)[0])
    data[: len(first)] = first
    view, got = memoryview(data), len(first)
    while got < len(data):
        _wait(fd, deadline)
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError
        got += n
    return view[head:]


def _wait(fd: int, deadline: float, write: bool = False) -> None:
    """Until `fd` can be written (`write`) or read, else TimeoutError at `deadline`. A pipe whose
    other end is closed counts as ready: the write or read that follows says so."""
    poll = select.poll()
    poll.register(fd, select.POLLOUT if write else select.POLLIN)
    if not poll.poll(max(0, (deadline - time.monotonic()) * 1000)):
        raise TimeoutError


def _feeds(batch: dict[str, Tensor]) -> dict[str, Any]:
    return {n: batch[n].cpu().numpy() for n in NAMES}


def ctranslate2_rows(
    model_dir: Path, workdir: Path, device: torch.device, threads: int, worker: PeerProcess | None
) -> dict[str, Row]:
    """CTranslate2 encoders, fp32 and int8 weights, converted from the checkpoint with its
    own transformers converter. They get the real tokens of each sequence (CTranslate2
    pads internally), as a CTranslate2 user would pass them. On the CPU they run in
    `worker`, a process of their own (peer_worker.py says why); on CUDA here."""
    ct2 = require("ctranslate2")
    _check_worker(worker, device)
    out = workdir / "ctranslate2"
    ct2.converters.TransformersConverter(str(model_dir)).convert(str(out), force=True)
    int8 = "int8" if device.type == "cpu" else "int8_float16"
    rows = {}
    for label, compute_type in (("fp32", "float32"), ("int8", int8)):
        name = f"CTranslate2 {ct2.__version__}, {label}"
        if worker is not None:
            options = {"path": str(out), "compute_type": compute_type, "threads": threads}
            rows[name] = worker.build(name, "ctranslate2", options)
        else:
            encoder = ct2.Encoder(str(out), device=device.type, compute_type=compute_type, intra_threads=threads)
            rows[name] = Row(_ctranslate2_cuda_forward(encoder, device))
    return rows


def _ctranslate2_cuda_forward(encoder, device: torch.device) -> Forward:
    # The real-token lists as in peer_worker.ctranslate2_forward, which cannot import this
    # (torch-importing) package: change the two together.
    def forward(batch: dict[str, Tensor]) -> Tensor:
        lengths = batch["attention_mask"].sum(1).tolist()
        ids = [row[:n] for row, n in zip(batch["input_ids"].tolist(), lengths)]
        types = [row[:n] for row, n in zip(batch["token_type_ids"].tolist(), lengths)]
        hidden = encoder.forward_batch(ids, token_type_ids=types).last_hidden_state
        return torch.as_tensor(hidden, device=device)  # __cuda_array_interface__

    return forward


def _check_worker(worker: PeerProcess | None, device: torch.device) -> None:
    if (worker is None) != (device.type == "cuda"):
        raise ValueError(f"a peer runs in a PeerProcess on the CPU and in this process on CUDA, not on {device}")


def onnxruntime_rows(
    reference, workdir: Path, device: torch.device, threads: int, worker: PeerProcess | None
) -> dict[str, Row]:
    """ONNX Runtime on transformers' model exported with `torch.onnx.export(dynamo=True)`,
    dynamic batch and length, fp32; on the CPU in `worker`, a process of its own."""
    ort = require("onnxruntime")
    require("onnxscript")
    _check_worker(worker, device)
    path = onnx_file(reference, workdir)
    name = f"ONNX Runtime {ort.__version__}, fp32 (exported from transformers)"
    if worker is not None:
        return {name: worker.build(name, "onnxruntime", {"path": str(path), "threads": threads})}
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CUDAExecutionProvider"])

    def forward(batch: dict[str, Tensor]) -> Tensor:
        return torch.from_numpy(session.run(["last_hidden_state"], _feeds(batch))[0])

    return {name: Row(forward)}


def openvino_rows(
    reference, workdir: Path, device: torch.device, threads: int, worker: PeerProcess | None, bf16: bool = False
) -> dict[str, Row]:
    """OpenVINO's CPU plugin on transformers' model exported to ONNX (`onnx_file`, shared with
    ONNX Runtime) and converted by `openvino.convert_model`, in `worker`: fp32, and with `bf16`
    bf16 too (INFERENCE_PRECISION_HINT; peer_worker.openvino_forward says why fp32 asks for
    f32). CPU only: OpenVINO's GPU plugin is Intel's, not CUDA."""
    from importlib.metadata import version

    require("openvino")
    require("onnxscript")
    if worker is None:
        raise ValueError(f"OpenVINO rows run on the CPU only, not on {device}; use --device cpu")
    path = onnx_file(reference, workdir)
    rows = {}
    for precision in ("fp32", "bf16") if bf16 else ("fp32",):
        name = f"OpenVINO {version('openvino')}, {precision} (exported from transformers)"
        rows[name] = worker.build(name, "openvino", {"path": str(path), "threads": threads, "precision": precision})
    return rows


def onnx_file(reference, workdir: Path) -> Path:
    """transformers' model as ONNX in `workdir`, exported once (`onnx_export`) for every peer
    that reads it."""
    path = workdir / "transformers.onnx"
    return path if path.is_file() else onnx_export(reference, path)


def onnx_export(reference, path: Path) -> Path:
    """transformers' model as ONNX at `path` (`torch.onnx.export(dynamo=True)`), dynamic batch
    and length, outputs last_hidden_state and pooler_output."""
    example = _example_batch(reference.config.vocab_size)
    batch_dim, seq_dim = (
        torch.export.Dim("batch"),
        torch.export.Dim("seq", max=reference.config.max_position_embeddings),
    )
    # The exporter prints its progress on stdout, which holds the bench's tables.
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        program = torch.onnx.export(
            reference,
            tuple(example[n] for n in NAMES),
            dynamic_shapes={n: {0: batch_dim, 1: seq_dim} for n in NAMES},
            dynamo=True,
            input_names=list(NAMES),
            output_names=["last_hidden_state", "pooler_output"],
            verbose=False,
        )
    program.save(str(path))
    return path


def _example_batch(vocab_size: int) -> dict[str, Tensor]:
    # Two sequences of different lengths, so the exported graph keeps the mask general.
    ids = torch.randint(1000, min(2000, vocab_size), (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def sentence_transformers_rows(model_dir: Path, device: torch.device) -> dict[str, Row]:
    """sentence-transformers' module stack on the same checkpoint, up to its token
    embeddings (the transformer's last hidden state, before pooling)."""
    st = require("sentence_transformers")
    model = st.SentenceTransformer(str(model_dir), device=str(device)).eval()

    def forward(batch: dict[str, Tensor]) -> Tensor:
        return model.forward(dict(batch))["token_embeddings"]

    return {f"sentence-transformers {st.__version__}": Row(forward)}


PEERS: dict[str, tuple[str, ...]] = {
    "ctranslate2": ("ctranslate2",),
    "onnxruntime": ("onnxruntime", "onnx", "onnxscript"),
    "openvino": ("openvino", "onnx", "onnxscript"),
    "sentence-transformers": ("sentence_transformers",),
}


def importable(module: str) -> bool:
    """Whether `module` imports (found is not enough: a broken install fails on import).
    OpenVINO and NNCF import with their telemetry kept out of this process, as of the workers
    (`peer_worker.keep_out`): NNCF starts its own at import, and the bench sends nothing."""
    if module.partition(".")[0] in ("openvino", "nncf"):
        peer_worker.keep_out(("openvino_telemetry",))
    try:
        require(module)
    except MissingExtra:
        return False
    return True


def peer_rows(
    peers: list[str],
    model_dir: Path,
    reference,
    workdir: Path,
    device: torch.device,
    threads: int,
    report,
    stack: contextlib.ExitStack,
    bf16: bool = False,
) -> dict[str, Row]:
    """The rows of every peer asked for that is installed and builds; the others are
    reported (not installed: the pip install that brings them; failed: why). On the CPU,
    CTranslate2, ONNX Runtime and OpenVINO each get a process of their own, ended with
    `stack`. With `bf16`, OpenVINO's bf16 row too (its name holds ", bf16")."""

    def worker() -> PeerProcess | None:
        return PeerProcess(stack) if device.type == "cpu" else None

    builders = {
        "ctranslate2": lambda: ctranslate2_rows(model_dir, workdir, device, threads, worker()),
        "onnxruntime": lambda: onnxruntime_rows(reference, workdir, device, threads, worker()),
        "openvino": lambda: openvino_rows(reference, workdir, device, threads, worker(), bf16),
        "sentence-transformers": lambda: sentence_transformers_rows(model_dir, device),
    }
    rows: dict[str, Row] = {}
    for peer in peers:
        missing = next((m for m in PEERS[peer] if not importable(m)), None)
        if missing:
            report.line(f"{peer}: not installed ({missing}): {install_hint(missing)}")
            continue
        try:
            rows.update(builders[peer]())
        except Exception as exc:  # a peer that fails to build is a missing row, not a failed bench
            log.debug("peer %s failed", peer, exc_info=True)
            report.line(f"{peer}: left out, it failed to build ({type(exc).__name__}: {str(exc)[:300]})")
    return rows

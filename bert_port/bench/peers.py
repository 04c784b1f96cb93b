"""The peers a user would pick instead of the port for a fast BERT: CTranslate2 (fp32 and
int8), ONNX Runtime (fp32, on a model exported from transformers) and sentence-transformers.

Each builder returns forward functions that take a padded batch (the dict `bert_port.encode`
gives) and return the last hidden state as a (B, T', H) float tensor, T' <= T (CTranslate2
returns only up to the longest real sequence). A peer that is not installed is left out,
with a line saying which `pip install` brings it; the bench goes on without it.

On the CPU, CTranslate2 and ONNX Runtime run in a process of their own (`PeerProcess`,
`peer_worker.py` says why); their forward functions carry a `timed` variant that the bench
times, which leaves the hidden state in that process.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from bert_port.extras import MissingExtra, install_hint, require

log = logging.getLogger(__name__)

Forward = Callable[[dict[str, Tensor]], Tensor]
NAMES = ("input_ids", "attention_mask", "token_type_ids")
WORKER = Path(__file__).with_name("peer_worker.py")


class PeerProcess:
    """`peer_worker.py` in a child process: CPU peers built and run there, each call timed
    here as a row of the bench (the request and a small reply cross a pipe; the hidden state
    comes back only for the parity pass). Started on the first `build`, ended by `stack`."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self.process: subprocess.Popen | None = None

    def build(self, name: str, kind: str, options: dict) -> Forward:
        if self.process is None:
            self.process = subprocess.Popen(
                [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            self.stack.callback(self.close)
        self._ask(("build", name, kind, options))

        def forward(batch: dict[str, Tensor], want_output: bool = True) -> Tensor | None:
            feeds = {n: batch[n].cpu().numpy() for n in NAMES}
            hidden = self._ask(("run", name, feeds, want_output))
            return None if hidden is None else torch.from_numpy(hidden)

        forward.timed = functools.partial(forward, want_output=False)  # what the bench times
        return forward

    def _ask(self, message):
        pickle.dump(message, self.process.stdin)
        self.process.stdin.flush()
        try:
            status, reply = pickle.load(self.process.stdout)
        except EOFError:
            raise RuntimeError(f"the peer process exited with code {self.process.wait()}") from None
        if status != "ok":
            raise RuntimeError(f"in the peer process:\n{reply}")
        return reply

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def ctranslate2_rows(
    model_dir: Path, workdir: Path, device: torch.device, threads: int, worker: PeerProcess | None
) -> dict[str, Forward]:
    """CTranslate2 encoders, fp32 and int8 weights, converted from the checkpoint with its
    own transformers converter. They get the real tokens of each sequence (CTranslate2
    pads internally), as a CTranslate2 user would pass them. On the CPU they run in
    `worker`, a process of their own (peer_worker.py says why)."""
    ct2 = require("ctranslate2")
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
            rows[name] = _ctranslate2_forward(encoder, device)
    return rows


def _ctranslate2_forward(encoder, device: torch.device) -> Forward:
    """In this process (CUDA: no OpenMP teams to contend)."""

    def forward(batch: dict[str, Tensor]) -> Tensor:
        lengths = batch["attention_mask"].sum(1).tolist()
        ids = [row[:n] for row, n in zip(batch["input_ids"].tolist(), lengths)]
        types = [row[:n] for row, n in zip(batch["token_type_ids"].tolist(), lengths)]
        hidden = encoder.forward_batch(ids, token_type_ids=types).last_hidden_state
        return torch.as_tensor(hidden, device=device)  # __cuda_array_interface__

    return forward


def onnxruntime_rows(
    reference, workdir: Path, device: torch.device, threads: int, worker: PeerProcess | None
) -> dict[str, Forward]:
    """ONNX Runtime on transformers' model exported with `torch.onnx.export(dynamo=True)`,
    dynamic batch and length, fp32; on the CPU in `worker`, a process of its own."""
    ort = require("onnxruntime")
    require("onnxscript")
    path = workdir / "transformers.onnx"
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
    name = f"ONNX Runtime {ort.__version__}, fp32 (exported from transformers)"
    if worker is not None:
        return {name: worker.build(name, "onnxruntime", {"path": str(path), "threads": threads})}
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CUDAExecutionProvider"])

    def forward(batch: dict[str, Tensor]) -> Tensor:
        feeds = {n: batch[n].cpu().numpy() for n in NAMES}
        return torch.from_numpy(session.run(["last_hidden_state"], feeds)[0])

    return {name: forward}


def _example_batch(vocab_size: int) -> dict[str, Tensor]:
    # Two sequences of different lengths, so the exported graph keeps the mask general.
    ids = torch.randint(1000, min(2000, vocab_size), (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def sentence_transformers_rows(model_dir: Path, device: torch.device) -> dict[str, Forward]:
    """sentence-transformers' module stack on the same checkpoint, up to its token
    embeddings (the transformer's last hidden state, before pooling)."""
    st = require("sentence_transformers")
    model = st.SentenceTransformer(str(model_dir), device=str(device)).eval()

    def forward(batch: dict[str, Tensor]) -> Tensor:
        return model.forward(dict(batch))["token_embeddings"]

    return {f"sentence-transformers {st.__version__}": forward}


PEERS: dict[str, tuple[str, ...]] = {
    "ctranslate2": ("ctranslate2",),
    "onnxruntime": ("onnxruntime", "onnx", "onnxscript"),
    "sentence-transformers": ("sentence_transformers",),
}


def importable(module: str) -> bool:
    """Whether `module` imports (found is not enough: a broken install fails on import)."""
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
) -> dict[str, Forward]:
    """Forward functions of every peer asked for that is installed and builds; the others
    are reported (not installed: the pip install that brings them; failed: why). The CPU
    peers' process ends with `stack`."""
    worker = PeerProcess(stack) if device.type == "cpu" else None
    builders = {
        "ctranslate2": lambda: ctranslate2_rows(model_dir, workdir, device, threads, worker),
        "onnxruntime": lambda: onnxruntime_rows(reference, workdir, device, threads, worker),
        "sentence-transformers": lambda: sentence_transformers_rows(model_dir, device),
    }
    rows: dict[str, Forward] = {}
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

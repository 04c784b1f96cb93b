"""A CPU peer (CTranslate2, ONNX Runtime, OpenVINO) in a process of its own, without torch.

Run as a script (`python peer_worker.py`, not `-m`: the package's `__init__` imports torch),
and driven by `peers.PeerProcess` over stdin/stdout with pickled messages:

- `("build", name, kind, options)` -> `("ok", None)`: load a CTranslate2 encoder
  (`kind="ctranslate2"`, options `path`, `compute_type`, `threads`) or an ONNX Runtime
  session (`kind="onnxruntime"`, options `path`, `threads`) or an OpenVINO compiled model
  (`kind="openvino"`, options `path`, `threads`, `precision`, `calibration`) under `name`;
- `("run", name, batch, want_output)` -> `("ok", last_hidden_state or None)`: one forward on
  a padded batch (a dict of int64 numpy arrays: input_ids, attention_mask, token_type_ids);
- any failure -> `("error", text)`; end of input ends the process.

Why a process of its own: in one process with torch, CTranslate2 binds torch's libgomp (torch
loads it globally first), and its encoder thread starts a second OpenMP team in the same
runtime. With more OpenMP threads than CPUs, libgomp stops spinning and parks every thread on
a futex between parallel regions, for torch's team too: the port's passes after one
CTranslate2 call were measured slower, with many times the context switches (the figures are
in docs/speed.md), which no user running one library sees. So each peer runs in a
process of its own, as its users run it. (Threads that spin for a moment after a call,
libgomp's or ONNX Runtime's, still take the cores from the next row, whichever process it runs
in; with the rows in a shuffled order, that falls on every row.)
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from typing import BinaryIO

if __name__ == "__main__":
    # Run as a script, this folder comes first on sys.path, where harness.py, load.py, ...
    # would shadow any top-level module of the same name that the peers import.
    sys.path.pop(0)

import numpy as np


def ctranslate2_forward(path: str, compute_type: str, threads: int):
    import ctranslate2

    encoder = ctranslate2.Encoder(path, device="cpu", compute_type=compute_type, intra_threads=threads)

    def forward(batch: dict[str, np.ndarray]) -> np.ndarray:
        # The real tokens of each sequence, as a CTranslate2 user passes them (it pads itself);
        # as in peers._ctranslate2_cuda_forward (this file cannot import the package): change both.
        lengths = batch["attention_mask"].sum(1).tolist()
        ids = [row[:n] for row, n in zip(batch["input_ids"].tolist(), lengths)]
        types = [row[:n] for row, n in zip(batch["token_type_ids"].tolist(), lengths)]
        return np.asarray(encoder.forward_batch(ids, token_type_ids=types).last_hidden_state)

    return forward


def onnxruntime_forward(path: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return lambda batch: session.run(["last_hidden_state"], batch)[0]


# One NNCF quantization per ONNX file, shared by the int8 rows at each thread count.
_QUANTIZED: dict[str, object] = {}


def openvino_forward(path: str, threads: int, precision: str, calibration: list | None = None):
    """OpenVINO's CPU plugin on the ONNX file at `path` (`openvino.convert_model`), at `threads`
    threads, one stream (the LATENCY hint: one batch at a time, as the bench calls it).
    `precision`: "fp32", "bf16", or "int8": NNCF post-training quantization
    (`nncf.quantize`, transformer preset) calibrated on `calibration`, a list of feeds.
    INFERENCE_PRECISION_HINT is always set: where the CPU has native bf16 the plugin picks
    bf16 by itself, so fp32 (and int8's layers left unquantized) must ask for f32."""
    import openvino as ov

    if precision == "int8":
        if path not in _QUANTIZED:
            import nncf

            dataset = nncf.Dataset(calibration)
            model = ov.convert_model(path)
            _QUANTIZED[path] = nncf.quantize(
                model, dataset, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(calibration)
            )
        model = _QUANTIZED[path]
    else:
        model = ov.convert_model(path)
    config = {
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32",
        "PERFORMANCE_HINT": "LATENCY",
    }
    request = ov.Core().compile_model(model, "CPU", config).create_infer_request()

    def forward(batch: dict[str, np.ndarray]) -> np.ndarray:
        request.infer(batch)
        # A view of the request's own buffer: `serve` pickles it before the next call.
        return request.get_tensor("last_hidden_state").data

    return forward


BUILDERS = {"ctranslate2": ctranslate2_forward, "onnxruntime": onnxruntime_forward, "openvino": openvino_forward}


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    forwards = {}
    while True:
        try:
            message = pickle.load(requests)
        except EOFError:
            return
        try:
            if message[0] == "build":
                _, name, kind, options = message
                forwards[name] = BUILDERS[kind](**options)
                reply = None
            else:
                _, name, batch, want_output = message
                hidden = forwards[name](batch)
                reply = hidden if want_output else None
            pickle.dump(("ok", reply), replies)
        except Exception:  # noqa: BLE001 (any failure goes back to the bench, which reports it)
            pickle.dump(("error", traceback.format_exc()), replies)
        replies.flush()


if __name__ == "__main__":
    # Ctrl-C is the bench's to handle: it closes our stdin, and we return.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # stdout is the reply channel: whatever a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, replies)

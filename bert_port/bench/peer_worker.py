"""A CPU peer (CTranslate2, ONNX Runtime, OpenVINO) in a process of its own, without torch.

Run as a script (`python peer_worker.py`, not `-m`: the package's `__init__` imports torch),
and driven by `peers.PeerProcess` over stdin (a stream of pickled requests) and stdout (each
reply a pickle after its length, 8 bytes little-endian, so that the bench can read it with a
deadline):

- `("build", name, kind, options)` -> `("ok", None)`: load a CTranslate2 encoder
  (`kind="ctranslate2"`, options `path`, `compute_type`, `threads`) or an ONNX Runtime
  session (`kind="onnxruntime"`, options `path`, `threads`) or an OpenVINO compiled model
  (`kind="openvino"`, options `path`, `threads`, `precision`, `calibration`) under `name`;
  `kind="stall"` (options `build_s`, `run_s`) is a peer that stops answering, for the tests of
  the bench's deadlines;
- `("run", name, batch, want_output)` -> `("ok", last_hidden_state or None)`: one forward on
  a padded batch (a dict of int64 numpy arrays: input_ids, attention_mask, token_type_ids);
- `("state", None)` -> `("ok", {...})`: what this process holds (`state`), for the tests;
- any failure -> `("error", text)`; end of input ends the process.

What never enters this process (`keep_out`, before any peer is imported): torch, and the
OpenVINO and NNCF telemetry. NNCF's `quantize` asks `get_backend` which framework the model
is from, and that probes torch (importing `nncf.torch`, `torch.utils.cpp_extension`,
setuptools) whenever torch imports; meanwhile openvino-telemetry's sender threads forked
(`multiprocessing`) to phone home, and a fork from a thread while the main thread imports
deadlocked the worker. Here torch fails to import, as where it is not installed, so
NNCF settles on OpenVINO without it; `openvino_telemetry` fails to import too, and OpenVINO's
converter and NNCF then use their own stubs (what they do where it is not installed), so no
thread is started, nothing is forked or sent, and no client ID is written under ~/intel.
`NNCF_CI=1`, NNCF's own switch, is set as well (`peers.PeerProcess` sets it in our
environment). Sending usage data is the user's call, not this bench's.

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

import importlib.abc
import importlib.machinery
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from typing import BinaryIO

if __name__ == "__main__":
    # Run as a script, this folder comes first on sys.path, where harness.py, load.py, ...
    # would shadow any top-level module of the same name that the peers import.
    sys.path.pop(0)

import numpy as np

# Imports this process refuses (`keep_out`), and the environment it runs in (set by the bench too).
KEPT_OUT = ("torch", "openvino_telemetry")
ENVIRONMENT = {"NNCF_CI": "1"}
REPLY_LENGTH = struct.Struct("<Q")  # the length of each pickled reply, before it


class _Refused(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of `names` (and their submodules), and fails to load them: `import torch`
    raises ModuleNotFoundError, as where torch is not installed, and `importlib.util.find_spec`
    gives a spec without an origin, which NNCF reads as "not installed" too."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (the peer worker keeps it out)", name=spec.name)

    def exec_module(self, module):  # never reached: create_module raises
        raise ModuleNotFoundError(module.__name__)


def keep_out(modules: tuple[str, ...] = KEPT_OUT) -> None:
    """`modules` refused in this process from now on, and ENVIRONMENT set: the worker keeps
    torch and the telemetry out before it imports any peer (the module's docstring says why);
    the bench keeps the telemetry out of its own process before it imports OpenVINO or NNCF to
    see whether they are installed (`peers.importable`)."""
    os.environ.update(ENVIRONMENT)
    finder = next((f for f in sys.meta_path if isinstance(f, _Refused)), None)
    if finder is None:
        finder = _Refused()
        sys.meta_path.insert(0, finder)
    finder.names.update(modules)


_FORKS = [0]  # os.fork calls in this process (multiprocessing's fork start method among them)


def state() -> dict:
    """What this process holds: its Python threads, the forks it made, which of the modules it
    keeps out are imported (none, unless `keep_out` failed), and which peers it imported."""
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "forks": _FORKS[0],
        "imported": sorted(m for m in sys.modules if m.partition(".")[0] in KEPT_OUT and sys.modules[m] is not None),
        "peers": sorted(m for m in ("ctranslate2", "onnxruntime", "openvino", "nncf") if m in sys.modules),
    }


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


def stall_forward(build_s: float = 0.0, run_s: float = 0.0):
    """A peer that stops answering, for the tests of the bench's deadlines: its build sleeps
    `build_s` seconds, and each of its calls `run_s`."""
    time.sleep(build_s)

    def forward(batch: dict[str, np.ndarray]) -> None:
        time.sleep(run_s)

    return forward


BUILDERS = {
    "ctranslate2": ctranslate2_forward,
    "onnxruntime": onnxruntime_forward,
    "openvino": openvino_forward,
    "stall": stall_forward,
}


def answer(message: tuple, forwards: dict):
    if message[0] == "build":
        _, name, kind, options = message
        forwards[name] = BUILDERS[kind](**options)
        return None
    if message[0] == "state":
        return state()
    _, name, batch, want_output = message
    hidden = forwards[name](batch)
    return hidden if want_output else None


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    forwards = {}
    while True:
        try:
            message = pickle.load(requests)
        except EOFError:
            return
        try:
            data = pickle.dumps(("ok", answer(message, forwards)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 (any failure goes back to the bench, which reports it)
            data = pickle.dumps(("error", traceback.format_exc()))
        replies.write(REPLY_LENGTH.pack(len(data)))
        replies.write(data)
        replies.flush()


if __name__ == "__main__":
    keep_out()
    os.register_at_fork(before=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))
    # Ctrl-C is the bench's to handle: it closes our stdin, and we return.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # stdout is the reply channel: whatever a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, replies)

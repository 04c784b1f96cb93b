"""ONNX export of any port model (`BertModel` or a head), checked by ONNX Runtime at export:
`export_onnx(model, path, tokenizer)` traces the model with `torch.onnx.export(dynamo=True)`
on dynamic batch and sequence dimensions, then runs the file in ONNX Runtime on a batch of
another shape and compares every output with the eager model's (real tokens only for
per-token outputs) within `tolerance.tolerance_for(torch.float32)`; `bert-port-convert --to
onnx` calls it. Needs onnx, onnxscript and onnxruntime (`pip install 'bert-port[onnx]'`).

While traced the model runs its padded path (packing needs the lengths on the host), so the
file computes transformers' padded operations; pad positions of per-token outputs are not
compared (the eager default model leaves them zeros). docs/export.md has the details.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .storage.staging import StagedWrite
from .tolerance import Tolerance, tolerance_for

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# Traced on the first texts, checked on the second (another batch size and length: the
# dimensions must be dynamic for the check to pass).
TRACE_TEXTS = ("an example sentence", "and a second, longer example sentence")
CHECK_TEXTS = (
    "the film is a quiet triumph , funny and sad at once .",
    "ok",
    "Can you pick up some milk and bread on your way home tonight? The shop closes at nine.",
)
PER_TOKEN = ("start_logits", "end_logits")  # (B, T) outputs; every (B, T, ...) output is per token too
SKIPPED = ("loss", "hidden_states", "attentions", "past_key_values")


class ExportError(RuntimeError):
    """A model that cannot be exported, or an ONNX file whose outputs differ from the model's."""


@dataclass
class OnnxExport:
    """What `export_onnx` wrote and measured: the file, its outputs, and each output's largest
    |onnxruntime - eager| on the check batch, within `tolerance`."""

    path: Path
    outputs: list[str]
    tolerance: Tolerance
    worst: dict[str, float] = field(default_factory=dict)
    sha256: str = ""  # of the file that passed the check
    size: int = 0  # its bytes


class _Outputs(nn.Module):
    """The model with positional inputs and a tuple of named outputs: what ONNX's graph needs."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor) -> tuple[Tensor, ...]:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return tuple(out[name] for name in self.names)


def output_names(model: nn.Module, batch: dict[str, Tensor]) -> list[str]:
    """The tensor outputs of `model` on `batch`, in its order (loss, hidden states and caches left out)."""
    with torch.inference_mode():
        out = model(**batch)
    return [name for name, value in out.items() if isinstance(value, Tensor) and name not in SKIPPED]


def _check_exportable(model: nn.Module) -> None:
    from .speed.quantization import is_quantized

    if is_quantized(model):
        raise ExportError(
            "an int8 model does not export to ONNX: export the float32 model (load without quantization=)"
        )
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ExportError(
            f"ONNX export takes a float32 model on the CPU, got {model.dtype} on {model.device}: "
            "load it with dtype=torch.float32"
        )


@contextlib.contextmanager
def _quiet_exporter():
    """torch.onnx's progress lines (stdout), its warnings and its registry's log lines (ops of
    packages not installed, such as torchvision's) are about the exporter, not the model."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export_onnx(
    model: nn.Module, path: str | os.PathLike, tokenizer, *, stage: StagedWrite | None = None
) -> OnnxExport:
    """Write `model` (float32, CPU) to the ONNX file `path`, inputs `INPUTS` with dynamic batch
    and sequence, outputs the model's own tensor outputs by name; then check the file in ONNX
    Runtime (`check_onnx`). The file is staged as every save is (`storage.staging`): a random
    temporary in its folder, created exclusively and never written through a link, checked, then
    renamed over `path` in one step; `stage`, a `StagedWrite` of `path`'s folder, commits it with
    that write's other files (the CLI's config and tokenizer), else it commits on its own. The
    folder's lock makes exports into one folder take turns, so each checks its own file.
    Raises `ExportError` on a model that cannot export or a file that fails the check."""
    path = Path(path)
    if stage is None:
        with StagedWrite(path.parent) as own:
            return export_onnx(model, path, tokenizer, stage=own)
    if Path(stage.directory).resolve() != path.parent.resolve():
        raise ValueError(f"{path} is not in the folder {stage.directory} that `stage` writes")
    from .tokenization import encode

    data, names = _traced(model, tokenizer)
    staged = stage.data(path.name, data)
    del data
    written = _read_file(staged)  # what is checked is what the folder holds, read back
    checked = {k: v for k, v in encode(tokenizer, list(CHECK_TEXTS)).items() if k in INPUTS}
    worst = _check_file(written, path, model, checked, names)
    sha256 = hashlib.sha256(written).hexdigest()
    return OnnxExport(path, names, tolerance_for(torch.float32), worst, sha256, len(written))


def _traced(model: nn.Module, tokenizer) -> tuple[bytes, list[str]]:
    """The ONNX file of `model`, as bytes, and its output names."""
    from .extras import require
    from .tokenization import encode

    for module in ("onnx", "onnxscript", "onnxruntime"):
        require(module, "ONNX export")
    _check_exportable(model)
    model.eval()
    traced = {k: v for k, v in encode(tokenizer, list(TRACE_TEXTS)).items() if k in INPUTS}
    names = output_names(model, traced)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=model.config.max_position_embeddings)
    with _quiet_exporter():
        program = torch.onnx.export(
            _Outputs(model, names),
            tuple(traced[name] for name in INPUTS),
            dynamic_shapes={name: {0: batch, 1: seq} for name in INPUTS},
            input_names=list(INPUTS),
            output_names=names,
            dynamo=True,
        )
        try:
            return program.model_proto.SerializeToString(), names
        except ValueError as exc:  # protobuf's 2 GiB limit on one message
            raise ExportError(
                f"the model does not fit one ONNX file ({exc}): export a model under 2 GiB of float32 weights"
            ) from None


def _read_file(path: Path) -> bytes:
    """The bytes of `path`, never read through a link: what was checked is the file itself."""
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
        return f.read()


def check_onnx(
    path: str | os.PathLike, model: nn.Module, batch: dict[str, Tensor], names: list[str]
) -> dict[str, float]:
    """The ONNX file `path` (never read through a link) checked by `_check_file`."""
    return _check_file(_read_file(Path(path)), path, model, batch, names)


def _check_file(
    data: bytes, path: str | os.PathLike, model: nn.Module, batch: dict[str, Tensor], names: list[str]
) -> dict[str, float]:
    """Each output's largest |onnxruntime - eager| on `batch` for the ONNX file `data` (read
    from `path`), per-token outputs on real tokens only. An output passes within the float32 tolerance, or, where the model's own two paths
    (packed, and the padded one the file computes) are further apart than that, within twice
    their distance: a vocabulary's logits sum 30,522 rounding errors of the hidden states, and
    all-MiniLM-L6-v2's MLM logits differ by 1.3e-5 between the port's own paths. `ExportError`
    names the first output beyond both."""
    import onnxruntime as ort

    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    got = dict(zip(names, session.run(names, {name: batch[name].numpy() for name in INPUTS})))
    real = batch["attention_mask"].bool()  # (B, T)
    expected, spread = _eager_and_spread(model, batch, names, real)
    tol, worst = tolerance_for(torch.float32), {}
    for name in names:
        ours, ref = torch.from_numpy(got[name]), expected[name]
        if ours.shape != ref.shape:
            raise ExportError(f"{path}: output {name} has shape {tuple(ours.shape)}, the model's {tuple(ref.shape)}")
        ours, ref = _compared(ours, name, real), _compared(ref, name, real)
        diff = (ours - ref).abs()
        worst[name] = diff.max().item() if diff.numel() else 0.0
        over = diff > tol.atol + tol.rtol * ref.abs()
        if bool(over.any()) and worst[name] > 2 * spread[name]:
            raise ExportError(
                f"{path}: ONNX Runtime's {name} differs from the model's by up to {worst[name]:.3g}: "
                f"{int(over.sum())} values beyond the float32 tolerance ({tol}), and more than twice the "
                f"model's own packed-to-padded spread ({spread[name]:.3g})"
            )
    return worst


def _compared(value: Tensor, name: str, real: Tensor) -> Tensor:
    """The values an output is compared on: real tokens only for per-token outputs."""
    return value[real] if value.dim() >= 3 or name in PER_TOKEN else value


def _eager_and_spread(
    model: nn.Module, batch: dict[str, Tensor], names: list[str], real: Tensor
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The model's outputs on `batch`, and per output the largest distance between them and
    the plain model's padded path (`speed.restore`; 0 for a model the speed layer left alone)."""
    from . import speed

    with torch.inference_mode():
        expected = model(**batch)
    spread = dict.fromkeys(names, 0.0)
    if not speed.is_optimized(model):
        return expected, spread
    invariant = next(m.batch_invariant for m in model.modules() if hasattr(m, "batch_invariant"))
    speed.restore(model)
    try:
        with torch.inference_mode():
            padded = model(**batch)
    finally:
        speed.optimize(model, batch_invariant=invariant)
    for name in names:
        diff = _compared(expected[name], name, real) - _compared(padded[name], name, real)
        spread[name] = diff.abs().max().item() if diff.numel() else 0.0
    return expected, spread

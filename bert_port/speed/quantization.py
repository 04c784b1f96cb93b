"""int8 inference on the CPU: `quantize(model, tokenizer)`, which `from_pretrained(path,
quantization="int8")` calls, and `Int8Linear`, the layer it puts in place of the encoder's
dense layers: int8 weights per output channel, 7-bit activations per row (so a row's result
never depends on the others), SmoothQuant-style shift and smoothing where a LayerNorm feeds the
projection, and a few outlier channels kept in float32 (the FFN's, and the widest of each
LayerNorm-fed projection's after smoothing). The scheme, and why each
choice, with its measurements: docs/int8.md. An int8 model runs inference on the CPU only:
training, CUDA, other dtypes and saving are refused with errors that say what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..packing import Packing
from . import kernels
from .gemm import stack_linears
from .swaps import is_optimized, optimize

QUANTIZATIONS = ("int8",)
ACTIVATION_LEVELS = 127  # 7 bits: see the module docstring (no int16 saturation without VNNI)
WEIGHT_LEVELS = 127  # symmetric int8
SMOOTHING_ALPHA = 0.5  # SmoothQuant's migration strength
# Of the channels a LayerNorm feeds the QKV and FFN-up projections, the few whose range stays widest
# after smoothing are kept in float32: MiniLM's channel 99 at [CLS] reaches 15x the row's RMS and set
# the step of that row, which short texts (4-5 tokens, [CLS] a fifth of the mean pooling) felt most.
LN_FLOAT_CHANNELS = 2
FLOAT_OUTLIERS = 8  # of the FFN's channels, kept in float32 by out_dense (LLM.int8()'s decomposition)
# oneDNN builds an int8 kernel for every row count it meets (several times the GEMM's own time,
# docs/int8.md): packed batches come in steps of this many
# rows (the fp32 ones in steps of speed.gemm.FP32_ROW_STEP), so that a corpus of batches reuses a few.
INT8_ROW_STEP = 64

# Sentences of several kinds and lengths, written for this (none is from the MR or SMS sets),
# run once through the float32 model to find each LayerNorm-fed projection's input range per
# channel. The channels that stand out are the
# model's own (set by LayerNorm weights), so a couple of dozen ordinary sentences find them.
CALIBRATION_TEXTS: tuple[str, ...] = (
    "a warm , funny and quietly moving film about two brothers .",
    (
        "the script hits every beat you expect , the jokes land a second too late , and by the third act even the "
        "actors seem to be waiting for the credits ; a long , loud and strangely weightless evening at the movies ."
    ),
    "the lead gives a fine , understated performance .",
    "The committee will publish its final report on the proposed railway extension next spring.",
    "Researchers found that the new alloy keeps its strength at temperatures above 900 degrees.",
    "Can you pick up some milk and bread on your way home tonight?",
    "CONGRATS! u have won a 2-night city break. Reply WIN to 80082 now, T&Cs apply, 18+ only",
    "r u still at the station? cant find u... ill wait by the clock k",
    "The museum's new wing, designed by a Danish studio, opens to the public on 3 March.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "I've been waiting for over an hour and nobody has answered the phone.",
    "Der Zug nach München fährt um 14:32 Uhr von Gleis 7 ab.",
    "東京は日本の首都です。",
    "Q3 revenue rose 12% year over year to $4.8 billion, beating analysts' estimates.",
    "def add(a, b): return a + b  # adds two numbers",
    "yes",
)
CALIBRATION_PAIRS: tuple[tuple[str, str], ...] = (
    ("How do I reset my password?", "Click 'Forgot password' on the sign-in page and follow the email link."),
    ("The cat sat on the mat.", "A dog is running through the park."),
)


class QuantizationError(RuntimeError):
    """An int8 model used where it cannot run (training, CUDA, another dtype) or saved."""


def check_quantization(quantization: str | None) -> str | None:
    """`quantization` if the port has it (None or "int8"), else a `ValueError` naming the choices."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, got {quantization!r}"
        )
    if quantization is not None and not torch.backends.mkldnn.is_available():
        raise ValueError(
            "quantization='int8' runs on oneDNN's int8 kernels, which this torch build lacks "
            "(torch.backends.mkldnn.is_available() is False); load in floating point"
        )
    return quantization


# Greatest lower bounds of `hidden_act` (rounded down): `out_dense` reads the activation's
# output, so x - floor >= 0 and its rows are quantized unsigned (all 128 levels on [floor, max]).
ACTIVATION_FLOORS = {
    **dict.fromkeys(
        ("gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast", "gelu_accurate"),
        -0.17,  # GELU's minimum, -0.16997 at x = -0.75; quick_gelu's is -0.16
    ),
    "gelu_10": -0.17,
    "quick_gelu": -0.17,
    **dict.fromkeys(("relu", "relu2", "relu6", "sigmoid", "laplace", "sqrtsoftplus"), 0.0),
    **dict.fromkeys(("silu", "swish"), -0.279),  # -0.2785
    "mish": -0.309,  # -0.3088
    "hardswish": -0.375,
    "tanh": -1.0,
}
TINY = torch.finfo(torch.float32).tiny


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights and per-row 7-bit activations (the module docstring has
    the scheme): x (..., K) float32 -> (..., M) float32, on the CPU, in inference.

    Optional, per input channel k: `shift` (K,) is subtracted from x before quantizing and
    added back through the bias (y = (x - shift) W^T + (b + W shift)), `smooth` (K,) divides
    x and multiplies W's column (SmoothQuant). `floor`: a lower bound of every input (the
    activation's minimum), which makes rows unsigned, x - floor in 0..127 steps; else rows are
    signed, -63..63 around the zero point 64. The buffers are what the module holds; oneDNN's
    packed weight is derived from them and rebuilt after a copy or unpickle."""

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        *,
        shift: Tensor | None = None,
        smooth: Tensor | None = None,
        floor: float | None = None,
        float_inputs: int = 0,
        float_channels: Tensor | None = None,
    ):
        super().__init__()
        self.training = False  # inference only (`_check`)
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        bias = torch.zeros(self.out_features) if bias is None else bias.detach().float()
        # The last `float_inputs` input channels (outliers, put there by the caller) stay float32;
        # or, where the input cannot be reordered (a LayerNorm's output, also the residual), the
        # channels at `float_channels`: their int8 column and input are zeroed, so they set no row's step.
        if float_channels is not None and (floor is not None or float_inputs):
            raise ValueError("Int8Linear: float_channels takes neither a floor nor float_inputs")
        self.float_inputs = float_inputs
        self.register_buffer("float_channels", None if float_channels is None else float_channels.long())
        columns = slice(weight.shape[1] - float_inputs, None) if float_channels is None else self.float_channels
        self.register_buffer("float_weight", weight[:, columns].T.contiguous())  # (F, M)
        weight = weight[:, : weight.shape[1] - float_inputs].clone()
        self.floor = floor
        int8_inputs = weight.shape[1]
        if float_channels is not None:
            weight[:, self.float_channels] = 0.0  # also keeps their shift out of the bias below
            shift = torch.zeros(int8_inputs) if shift is None else shift
        if floor is not None:
            shift = torch.full((int8_inputs,), float(floor))
        if shift is not None:
            bias = bias + weight @ shift.float()
        if floor is None and (shift is not None or smooth is not None):
            inverse = torch.ones(int8_inputs) if smooth is None else 1.0 / smooth.float()
            centre = torch.zeros(int8_inputs) if shift is None else shift.float()
            if float_channels is not None:
                inverse[self.float_channels] = 0.0  # x' = 0 there: the row's step ignores them
            self.register_buffer("input_scale", inverse)  # x' = x * input_scale + input_offset
            self.register_buffer("input_offset", -centre * inverse)
        else:
            self.input_scale = self.input_offset = None
        if smooth is not None:
            weight = weight * smooth.float()[None, :]
        scale = (weight.abs().amax(dim=1) / WEIGHT_LEVELS).clamp_min(TINY)  # (M,)
        int8 = torch.round(weight / scale[:, None]).clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)  # (M, K)
        self.register_buffer("weight_int8", int8)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias.clone())
        self._pack()

    def _pack(self) -> None:
        # oneDNN's layout of the weight: an opaque tensor, neither copied nor pickled.
        self._packed = torch.ops.onednn.qlinear_prepack(self.weight_int8, None)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_packed", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._pack()

    fuses_epilogue = True  # `forward` adds the residual (speed.layers.FusedBertLayer.add_norm)
    activation: Callable | None = None  # the FFN's, taken in from the layer as `RowStableLinear` takes it

    def row_multiple(self, x: Tensor) -> int:
        """Packed rows are best a multiple of `INT8_ROW_STEP` (`BertModel.encode` adds filler rows)."""
        return INT8_ROW_STEP

    @torch.no_grad()  # inference only: with gradients on (no inference_mode), nothing is recorded
    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """`epilogue(linear(x), activation, residual)`, in place on the dequantized output (without
        an activation, the residual is added within the dequantization)."""
        self._check(x)
        rows = x.reshape(-1, self.in_features)  # (N, K)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        q, step = self._quantize(rows[:, : self.in_features - self.float_inputs])  # (N, K - F) uint8, (N, 1)
        if self.float_channels is None:
            kept = rows[:, self.in_features - self.float_inputs :]  # (N, F): the outlier channels, float32
        else:
            kept = rows.index_select(1, self.float_channels)  # (N, F)
        zero_point = 0 if self.floor is not None else ACTIVATION_LEVELS // 2 + 1
        acc = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, zero_point, self._packed, self.weight_scale, None, None, 1.0, 0, torch.float32, "none", [], ""
        )  # (N, M): sum_k (q_k - zero_point) W_int8[m, k] * weight_scale[m]
        activation = self.activation
        if activation is None:
            return self._dequantize(acc, step, kept, residual).view(*x.shape[:-1], self.out_features)
        out = self._dequantize(acc, step, kept, None)
        out = torch._C._nn.gelu_(out) if activation is F.gelu else activation(out)
        if residual is not None:
            out += residual.reshape(out.shape)
        return out.view(*x.shape[:-1], self.out_features)

    def _quantize(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The (N, K) float rows (unit stride) as uint8, and each row's step, (N, 1)."""
        if kernels.available():
            return kernels.quantize_rows(rows, self.input_scale, self.input_offset, self.floor)
        if self.input_scale is not None:
            rows = torch.addcmul(self.input_offset, rows, self.input_scale)
        step = self._steps(rows)  # (N, 1)
        inverse = 1.0 / step
        if self.floor is not None:  # unsigned: (x - floor) / step in 0..127
            q = (rows * inverse).add_(0.5 - self.floor * inverse)  # (faster than addcmul)
        else:  # signed: x / step in -63..63, stored around 64
            q = (rows * inverse).add_(ACTIVATION_LEVELS // 2 + 1.5)
        # + 0.5 and truncation round half up; the values are 0..127, where int8 and uint8 share
        # their bits (and float -> int8 converts several times faster than float -> uint8).
        return q.to(torch.int8).view(torch.uint8), step

    def _dequantize(self, acc: Tensor, step: Tensor, kept: Tensor, residual: Tensor | None) -> Tensor:
        """In place on the (N, M) products, in this order: bias + products * step; + the outlier
        channels' float32 product, `kept` (N, F) x `float_weight` (F, M), summed channel by channel
        (a float32 GEMM, addmm, would sum them in an order that changes with N); + `residual`."""
        residual = None if residual is None else residual.reshape(acc.shape)
        if kernels.available() and (residual is None or residual.dtype == torch.float32):
            kernels.dequantize_rows(acc, step, self.bias, kept, self.float_weight, residual)
            return acc
        out = torch.addcmul(self.bias, acc, step, out=acc)
        for c in range(self.float_weight.shape[0]):
            out.addcmul_(kept[:, c : c + 1], self.float_weight[c])
        return out if residual is None else out.add_(residual)

    def _steps(self, rows: Tensor) -> Tensor:
        """The quantization step of each of the (N, K) rows, from the row's own range: (N, 1)."""
        if self.floor is not None:
            return ((rows.amax(dim=1, keepdim=True) - self.floor) / ACTIVATION_LEVELS).clamp_min(TINY)
        top = torch.maximum(rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_())
        return (top / (ACTIVATION_LEVELS // 2)).clamp_min(TINY)

    def _check(self, x: Tensor) -> None:
        if self.training:
            raise QuantizationError(
                "an int8 model runs inference only: call model.eval(); to fine-tune, train the float32 model "
                "and load the result with quantization='int8'"
            )
        if x.device.type != "cpu" or x.dtype != torch.float32:
            raise QuantizationError(
                f"an int8 model runs on the CPU with float32 activations, got {x.dtype} on {x.device}; load the "
                "model without quantization= for CUDA, bf16 or fp16"
            )
        if self.bias.dtype != torch.float32 or self.bias.device.type != "cpu":  # e.g. after model.to(torch.float16)
            raise QuantizationError(
                f"an int8 layer's scales and bias must stay float32 on the CPU, got {self.bias.dtype} on "
                f"{self.bias.device}; load the model again with quantization='int8' and do not convert it"
            )

    def extra_repr(self) -> str:
        rows = "unsigned" if self.floor is not None else "signed"
        pre = ", shifted/smoothed" if self.input_scale is not None else ""
        floats = self.float_weight.shape[0]
        kept = f", {floats} inputs in float32" if floats else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, 7-bit {rows} rows"
            f"{pre}{kept}"
        )


def smoothing(input_max: Tensor, weight: Tensor, alpha: float = SMOOTHING_ALPHA) -> Tensor:
    """SmoothQuant's divisor per input channel: a_k^alpha / max_m |W[m, k]|^(1 - alpha)."""
    floor = 1e-5  # a channel never used (or a zero column) keeps a finite divisor
    column_max = weight.detach().abs().amax(dim=0).clamp_min(floor)
    return (input_max.clamp_min(floor) ** alpha / column_max ** (1 - alpha)).clamp_min(floor)


Ranges = tuple[Tensor, Tensor, Tensor]  # per input channel: (K,) max, min and mean


@torch.inference_mode()
def calibrate(model: nn.Module, batches: Iterable[dict[str, Tensor]]) -> dict[tuple[int, str], Ranges]:
    """The largest, smallest and mean input per channel of the fused QKV ("qkv"),
    `interm_dense` and `out_dense` of every layer, over the real tokens of `batches` run
    through the (float32) encoder `model`: {(layer, name): (max, min, mean)}."""
    stats: dict[tuple[int, str], list[Tensor]] = {}
    filler = [0]  # the filler rows (packing.with_filler) after the real ones, in the layer running now

    def note_filler(layer: nn.Module, args: tuple, kwargs: dict) -> None:
        packing = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        filler[0] = packing.filler if isinstance(packing, Packing) else 0

    def record(key: tuple[int, str]):
        def hook(module: nn.Module, inputs: tuple) -> None:
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            x = x[: x.shape[0] - filler[0]]
            new = [x.amax(dim=0), x.amin(dim=0), x.sum(dim=0), torch.tensor(float(x.shape[0]))]
            if key in stats:
                old = stats[key]
                new = [torch.maximum(old[0], new[0]), torch.minimum(old[1], new[1]), old[2] + new[2], old[3] + new[3]]
            stats[key] = new

        return hook

    handles = []
    for i, layer in enumerate(model.bert_layers):
        handles.append(layer.register_forward_pre_hook(note_filler, with_kwargs=True))
        handles.append(layer.self_attention.register_forward_pre_hook(record((i, "qkv"))))
        handles.append(layer.interm_dense.register_forward_pre_hook(record((i, "interm_dense"))))
        handles.append(layer.out_dense.register_forward_pre_hook(record((i, "out_dense"))))
    config = model.config
    # Packed rows, less their filler: the real tokens only (an encoder; a decoder's pads, right
    # of its tokens, attend causally to them and look like them).
    saved = (config.attn_implementation, model.batch_invariant)
    config.attn_implementation, model.batch_invariant = "sdpa", False
    try:
        for batch in batches:
            model(**batch)
    finally:
        config.attn_implementation, model.batch_invariant = saved
        for handle in handles:
            handle.remove()
    return {key: (high, low, total / count) for key, (high, low, total, count) in stats.items()}


def centred(ranges: Ranges, weight: Tensor) -> dict[str, Tensor]:
    """`Int8Linear`'s shift (each channel's calibrated mean: robust where a range's midpoint
    follows one extreme token), SmoothQuant divisor (from the largest deviation from it) and
    float32 channels (the `LN_FLOAT_CHANNELS` widest after smoothing) for one LayerNorm-fed
    projection."""
    high, low, mean = ranges
    deviation = torch.maximum(high - mean, mean - low)
    smooth = smoothing(deviation, weight)
    kept = (deviation / smooth).argsort(descending=True)[:LN_FLOAT_CHANNELS].sort().values
    return {"shift": mean, "smooth": smooth, "float_channels": kept if LN_FLOAT_CHANNELS else None}


def calibration_batches(tokenizer, max_length: int) -> list[dict[str, Tensor]]:
    """`CALIBRATION_TEXTS` and `CALIBRATION_PAIRS` tokenized by the checkpoint's tokenizer."""
    from ..tokenization import encode

    firsts, seconds = zip(*CALIBRATION_PAIRS)
    return [
        dict(encode(tokenizer, list(CALIBRATION_TEXTS), max_length=max_length)),
        dict(encode(tokenizer, list(firsts), list(seconds), max_length=max_length)),
    ]


def quantize(model: nn.Module, tokenizer) -> nn.Module:
    """Make the encoder of a float32 port model (`BertModel` or any head; `model.encoder`) int8,
    in place: optimize it (`speed.optimize`, if not yet), calibrate on `CALIBRATION_TEXTS` with
    `tokenizer` (the checkpoint's), then put an `Int8Linear` in place of every dense layer of
    every `BertLayer` (the module docstring says which stay float32). Returns `model`, in eval mode."""
    if not is_optimized(model):
        optimize(model)
    encoder = model.encoder
    if is_quantized(model):
        raise QuantizationError("this model is int8 already")
    if encoder.dtype != torch.float32 or encoder.device.type != "cpu":
        raise QuantizationError(
            f"int8 quantization starts from float32 weights on the CPU; the model is {encoder.dtype} on "
            f"{encoder.device}: load it with dtype=torch.float32 on the CPU"
        )
    model.eval()
    stats = calibrate(encoder, calibration_batches(tokenizer, min(128, encoder.config.max_sequence_length)))
    floor = ACTIVATION_FLOORS.get(encoder.config.hidden_act)  # None: signed rows for out_dense too
    for i, layer in enumerate(encoder.bert_layers):
        attention = layer.self_attention
        weight, bias = stack_linears((attention.query, attention.key, attention.value))
        qkv = centred(stats[(i, "qkv")], weight)  # one shift and divisor for the three: x is quantized once
        attention.qkv = Int8Linear(weight, bias, **qkv)
        for name in ("query", "key", "value"):  # the padded path's three projections (left padding, eager)
            linear = getattr(attention, name)
            setattr(attention, name, Int8Linear(linear.weight, linear.bias, **qkv))
        interm, out = layer.interm_dense, layer.out_dense
        # The FFN's channels reordered so that the FLOAT_OUTLIERS largest (by calibration) come last,
        # where out_dense keeps them in float32: GELU acts on each channel alone, so this is exact.
        order = stats[(i, "out_dense")][0].argsort()
        layer.interm_dense = Int8Linear(
            interm.weight[order], interm.bias[order], **centred(stats[(i, "interm_dense")], interm.weight)
        )
        layer.interm_dense.activation = interm.activation  # (taken into the GEMM by `optimize`)
        layer.out_dense = Int8Linear(out.weight[:, order], out.bias, floor=floor, float_inputs=FLOAT_OUTLIERS)
        layer.attention_dense = Int8Linear(layer.attention_dense.weight, layer.attention_dense.bias)
    model.quantization = "int8"
    return model.eval()


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def refuse_saving(model: nn.Module) -> None:
    """A `QuantizationError` for an int8 model: its float32 weights are gone, and writing the
    dequantized ones would pass a rounded copy off as the checkpoint."""
    if is_quantized(model):
        raise QuantizationError(
            "an int8 model cannot be saved: quantization happens when loading, from the float32 weights. Save the "
            "float32 model (load it without quantization=) and load the saved folder with quantization='int8'"
        )


def quantize_for_loading(model: nn.Module) -> nn.Module:
    """`quantize` with the tokenizer of the folder `model` was loaded from (`from_pretrained`)."""
    from ..tokenization import TokenizerError, load_tokenizer

    try:
        tokenizer = load_tokenizer(model.source_dir)
    except TokenizerError as exc:
        raise TokenizerError(
            f"quantization='int8' calibrates on built-in sentences with the checkpoint's tokenizer: {exc}"
        ) from None
    return quantize(model, tokenizer)

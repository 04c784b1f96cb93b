"""Speed beside the model: swap fast modules into a loaded plain-PyTorch model, as liger-kernel's
`apply_liger_kernel_to_*` and torch.ao's `quantize_` do.

    model = BertModel.from_pretrained(path)              # optimize() already applied
    model = BertModel.from_pretrained(path, optimize=False)  # the plain model of bert.py
    optimize(model, batch_invariant=False)               # or by hand, on any port model
    quantize(model, tokenizer)                           # int8 on the CPU

`optimize` keeps every parameter, buffer and state-dict key: the model trains, saves and
exports as before. What it changes:

- the encoder runs on the real tokens of a right-padded batch only (`layers.PackedBertModel`);
- attention of packed sequences: the C kernel on the CPU in inference, varlen FlashAttention
  on CUDA (`attention.py`);
- every `nn.Linear` becomes a `gemm.RowStableLinear`: in CPU inference, oneDNN on a prepacked
  weight (AMX for bf16 where the CPU has it), with the FFN's activation and the residual in
  the GEMM's epilogue;
- with `batch_invariant` (the default) a text's outputs are the same bits alone or in any
  batch: filler rows up to `MIN_GEMM_ROWS`, GEMMs whose rows do not depend on the others.

The exact mode (`attn_implementation="eager"`, or `optimize=False`) runs bert.py's modules as
written: transformers' operations on transformers' shapes.
"""

from __future__ import annotations

from torch import nn

from ..bert import BertLayer, BertModel, BertSelfAttention
from .gemm import RowStableLinear
from .layers import FusedBertLayer, PackedBertModel, PackedSelfAttention
from .quantization import is_quantized, quantize

__all__ = ["is_optimized", "is_quantized", "optimize", "quantize"]

# plain class -> the class `optimize` gives it (a subclass that adds no parameter)
SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    BertModel: PackedBertModel,
    BertSelfAttention: PackedSelfAttention,
    BertLayer: FusedBertLayer,
}


def _identity(x):
    return x


def optimize(model: nn.Module, *, batch_invariant: bool = True) -> nn.Module:
    """Swap the fast modules into the port model `model` (any head), in place; returns it.
    Again on an optimized model, it sets `batch_invariant` anew."""
    for module in model.modules():
        fast = SWAPS.get(type(module))
        if fast is not None:
            module.__class__ = fast
        if isinstance(module, PackedSelfAttention) and "qkv" not in module._modules:
            module.register_module("qkv", None)  # int8's fused projection goes here (quantization.py)
        if isinstance(module, (PackedBertModel, PackedSelfAttention)):
            module.batch_invariant = batch_invariant
        if isinstance(module, FusedBertLayer) and type(module.interm_dense) is nn.Linear:
            # The FFN's activation moves into its GEMM's epilogue: same arithmetic, one pass fewer.
            RowStableLinear.swap(module.interm_dense, batch_invariant).activation = module.interm_af
            module.interm_af = _identity
    for module in list(model.modules()):
        if type(module) in (nn.Linear, RowStableLinear):
            RowStableLinear.swap(module, batch_invariant)
    return model


def restore(model: nn.Module) -> nn.Module:
    """The inverse of `optimize`: bert.py's plain modules again, in place; returns `model`.
    Refused for an int8 model, whose float weights are gone."""
    if is_quantized(model):
        raise ValueError("an int8 model cannot be restored to floating point: load the checkpoint again")
    plain = {fast: slow for slow, fast in SWAPS.items()}
    for module in model.modules():
        if isinstance(module, FusedBertLayer) and module.interm_af is _identity:
            module.interm_af, module.interm_dense.activation = module.interm_dense.activation, None
        if isinstance(module, PackedSelfAttention):
            del module._modules["qkv"]
        if type(module) in plain:
            module.__class__ = plain[type(module)]
        elif type(module) is RowStableLinear:
            RowStableLinear.train(module, module.training)  # drops the packed weight
            module.__class__ = nn.Linear
            for name in ("batch_invariant", "activation"):
                module.__dict__.pop(name, None)
    return model


def is_optimized(model: nn.Module) -> bool:
    return any(isinstance(m, PackedBertModel) for m in model.modules())

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

from .gemm import RowStableLinear
from .layers import FusedBertLayer, PackedSelfAttention
from .quantization import is_quantized, quantize
from .swaps import SWAPS, identity, is_optimized, optimize

__all__ = ["is_optimized", "is_quantized", "optimize", "quantize", "restore"]


def restore(model: nn.Module) -> nn.Module:
    """The inverse of `optimize`: bert.py's plain modules again, in place; returns `model`.
    Refused for an int8 model, whose float weights are gone."""
    if is_quantized(model):
        raise ValueError("an int8 model cannot be restored to floating point: load the checkpoint again")
    plain = {fast: slow for slow, fast in SWAPS.items()}
    for module in model.modules():
        if isinstance(module, FusedBertLayer) and module.interm_af is identity:
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

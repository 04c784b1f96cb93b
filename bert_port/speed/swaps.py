"""`optimize`: the fast modules swapped into a port model in place (`SWAPS`), and
`is_optimized`. Its inverse, `restore`, is in `__init__`, beside int8's refusal.
"""

from __future__ import annotations

from torch import nn

from ..bert import BertLayer, BertModel, BertSelfAttention
from .gemm import RowStableLinear
from .layers import FusedBertLayer, PackedBertModel, PackedSelfAttention

# plain class -> the class `optimize` gives it (a subclass that adds no parameter)
SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    BertModel: PackedBertModel,
    BertSelfAttention: PackedSelfAttention,
    BertLayer: FusedBertLayer,
}


def identity(x):
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
            module.interm_af = identity
    for module in list(model.modules()):
        if type(module) in (nn.Linear, RowStableLinear):
            RowStableLinear.swap(module, batch_invariant)
    return model


def is_optimized(model: nn.Module) -> bool:
    return any(isinstance(m, PackedBertModel) for m in model.modules())

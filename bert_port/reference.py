"""The transformers twin of a port model: the same class, config and weights, built in transformers.

The parity check, the fine-tuning recipe's `--reference hf`, the benchmark and the tests compare
against transformers through these functions, so the twin is built, and its attention
implementation chosen, in one place. transformers is imported on demand (the `parity` extra):
`import bert_port` never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .config import MEGATRON_MODEL_TYPE, BertConfig
from .extras import require
from .families import FAMILIES, family_of


def _transformers():
    return require("transformers")


def hf_config(config: BertConfig | Mapping):
    """transformers' config of the family (`BertConfig`, `RobertaConfig`, ...) with the same
    fields as `config` (a port config or a config.json dict, in the family's names); its
    `MegatronBertConfig` for a pre-LN one (`pre_norm`, model_type "megatron-bert")."""
    fields = config.to_dict() if isinstance(config, BertConfig) else dict(config)
    megatron = fields.get("pre_norm") is True or fields.get("model_type") == MEGATRON_MODEL_TYPE
    family = FAMILIES[MEGATRON_MODEL_TYPE] if megatron else family_of(fields.get("model_type"))
    return getattr(_transformers(), family.class_prefix + "Config")(**fields)


def random_hf_model(
    config: BertConfig | Mapping,
    cls_name: str = "BertModel",
    attn_implementation: str = "eager",
    seed: int = 0,
    **kwargs,
) -> nn.Module:
    """A randomly initialised transformers model (`transformers.<cls_name>`) for `config`, in
    eval mode, its weights drawn after `torch.manual_seed(seed)`. `kwargs` go to the
    constructor (`add_pooling_layer=False`)."""
    cls = getattr(_transformers(), cls_name)
    torch.manual_seed(seed)
    model = cls(hf_config(config), **kwargs)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def hf_twin(model: nn.Module, attn_implementation: str = "sdpa") -> nn.Module:
    """transformers' model of the same class as `model` (`model.hf_architecture`), holding its
    weights (loaded strictly from `model.hf_state_dict()`), on its device, in its dtype and
    train/eval mode. Building it does not move torch's RNG: transformers' random
    initialisation, thrown away here, must not change the dropout masks that follow."""
    transformers = _transformers()
    cls = getattr(transformers, model.hf_architecture)
    # A bare encoder (no head) says whether it has a pooler; DistilBERT's and ELECTRA's never do.
    bare = hasattr(model, "add_pooling_layer") and model.config.family.pooler
    kwargs = {"add_pooling_layer": model.add_pooling_layer} if bare else {}
    with torch.random.fork_rng(devices=[]):
        twin = cls(hf_config(model.config), **kwargs)
    twin.set_attn_implementation(attn_implementation)
    state = model.hf_state_dict()
    # Tied targets (an MLM decoder) are not in a saved state dict; torch's strict load wants them.
    state.update({target: state[source] for target, source in twin.all_tied_weights_keys.items()})
    twin.load_state_dict(state, strict=True)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return twin.to(device=next(model.parameters()).device, dtype=dtype).train(model.training)

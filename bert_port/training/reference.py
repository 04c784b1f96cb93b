"""The model a fine-tuning run trains, saves and reloads: `bert_port`'s
`BertForSequenceClassification` (`BertForTokenClassification` for token classification), or
with `reference="hf"` (`--reference hf`) its transformers twin (`bert_port.reference.hf_twin`),
started from the very same weights.

The twin is built after the port model, from its weights, without moving torch's RNG, so
both runs draw the same dropout masks in the same order: the two runs differ only in the
code of the forward and backward passes. transformers is imported on demand (the `parity`
extra); a missing install is a `MissingExtra` naming it, before any work.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from .. import checkpoint as ckpt
from ..assets import minilm_dir
from ..base_bert import BertPreTrainedModel
from ..classifier import BertForSequenceClassification
from ..config import BertConfig
from ..extras import require
from ..heads import BertForTokenClassification
from ..problem import ProblemType
from ..reference import hf_twin
from .settings import FinetuneConfig
from .steps import set_seed


def require_reference(reference: str) -> None:
    """Import what `reference` needs now, so that a missing package is refused before any work."""
    if reference == "hf":
        require("transformers")


def model_class(problem_type: str) -> type[BertPreTrainedModel]:
    """The port model of a problem type: a token classifier for token classification, else a
    sequence classifier."""
    if problem_type == ProblemType.TOKEN_CLASSIFICATION:
        return BertForTokenClassification
    return BertForSequenceClassification


def build_model(cfg: FinetuneConfig, names: list[str]) -> tuple[nn.Module, Path]:
    """The classifier to train, in train mode, and the directory of its tokenizer. The head
    is initialised from the seeded RNG; with `cfg.reference == "hf"` transformers' twin is
    returned, holding exactly the port model's initial weights. A token classifier's config
    names no `problem_type` (transformers' has none; see `bert_port.problem`)."""
    token = cfg.problem_type == ProblemType.TOKEN_CLASSIFICATION
    overrides: dict[str, Any] = {
        "id2label": dict(enumerate(names)),
        "label2id": {name: i for i, name in enumerate(names)},
        "problem_type": None if token else cfg.problem_type,
        "attn_implementation": cfg.attn_implementation,
    }
    if cfg.classifier_dropout is not None:
        overrides["classifier_dropout"] = cfg.classifier_dropout
    set_seed(cfg.seed)
    model = model_class(cfg.problem_type).from_pretrained(cfg.checkpoint or minilm_dir(), **overrides)
    source_dir = Path(model.source_dir)
    if cfg.reference == "hf":
        model = hf_twin(model, cfg.attn_implementation)  # leaves the RNG where the port model left it
    if cfg.freeze_encoder:  # the port's encoder, or the twin's (`roberta`, `distilbert`, ... in transformers)
        for param in (model.base_model if cfg.reference == "hf" else model.encoder).parameters():
            param.requires_grad_(False)
    return model.train(), source_dir


def load_trained(
    output_dir: str | os.PathLike, reference: str = "port", attn_implementation: str = "sdpa"
) -> nn.Module:
    """Load the saved best checkpoint with the implementation that trained it, as the class
    its config names (a sequence or a token classifier)."""
    config = BertConfig.from_json_file(ckpt.locate_checkpoint(output_dir).config_file)
    cls = model_class(ProblemType.of_config(config))
    if reference == "hf":
        transformers = require("transformers")
        return (
            getattr(transformers, config.family.architecture(cls.__name__))  # RobertaForSequenceClassification
            .from_pretrained(str(output_dir), attn_implementation=attn_implementation)
            .eval()
        )
    return cls.from_pretrained(output_dir, attn_implementation=attn_implementation)


def save_model(model: nn.Module, output_dir: Path, source_dir: Path) -> None:
    """HF-format checkpoint of `model` with the tokenizer files beside it."""
    if isinstance(model, BertPreTrainedModel):  # the port's: it copies the tokenizer files itself
        model.source_dir = source_dir
        model.save_pretrained(output_dir)
        return
    model.save_pretrained(str(output_dir))  # transformers' model: copy its tokenizer ourselves
    for name in ckpt.TOKENIZER_FILES:
        if (source_dir / name).is_file():
            with ckpt.atomic_write(output_dir / name) as tmp:
                tmp.write_bytes((source_dir / name).read_bytes())

"""`Predictor`: a fine-tuned model loaded once, and one prediction row per text, by the model's
`problem_type`, as `bert-port-predict` writes them (that command reads and writes the files
around it). Loading refuses, with one line each, what it cannot predict with: a model with no
labels, an activation for a classifier, int8 off the CPU or with bf16."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import ST_MODEL_CONFIG, locate_checkpoint
from ..config import BertConfig, ConfigError
from ..data import TextDataset
from ..devices import resolve_device
from ..problem import ProblemType, config_label_names
from ..storage import bounded
from ..threads import governed
from ..tokenization import encode, load_tokenizer
from .evaluation import predict as predict_scores
from .evaluation import predict_tokens
from .settings import FinetuneError, check_max_length

ACTIVATIONS = ("auto", "none", "sigmoid")
# The activations of sentence-transformers' CrossEncoder configs that are applied here.
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "none"}


@dataclasses.dataclass
class Predictor:
    """A loaded classifier or tagger and how it predicts; `Predictor.load(model_dir)` builds one,
    `predictor(texts)` returns the rows. `truncated` counts the inputs of the last call that
    were longer than `max_length` (read up to the cut)."""

    model: nn.Module
    tokenizer: Any
    problem: ProblemType
    names: list[str]
    max_length: int
    device: torch.device
    activation: str = "none"
    threshold: float = 0.5
    aggregation_strategy: str = "first"
    batch_size: int = 64
    bf16: bool = False
    threads: int | str | None = "auto"
    truncated: int = 0

    @classmethod
    def load(
        cls,
        model_dir: str | os.PathLike,
        *,
        device: str = "auto",
        max_length: int | None = None,
        quantization: str | None = None,
        activation: str = "auto",
        aggregation_strategy: str | None = None,
        **options: Any,
    ) -> Predictor:
        """The model in `model_dir` (a fine-tuned output folder or any HF classifier or tagger)
        and its settings: `max_length` defaults to the model's and tokenizer's limit, as
        transformers' pipeline and `CrossEncoder` read; `activation` ('auto', 'none',
        'sigmoid') is for score models; `options`: threshold, batch_size, bf16, threads."""
        from ..classifier import BertForSequenceClassification
        from ..heads import BertForTokenClassification

        unknown = sorted(set(options) - {"threshold", "batch_size", "bf16", "threads"})
        if unknown:
            raise TypeError(f"Predictor.load got unknown option(s) {', '.join(unknown)}")
        try:
            where = resolve_device(device, what="device")
        except ValueError as exc:
            raise FinetuneError(str(exc)) from None
        check_quantization(quantization, where, options.get("bf16", False))
        config, config_file = classifier_config(model_dir)
        problem = ProblemType.of_config(config)
        if problem is not ProblemType.TOKEN_CLASSIFICATION and aggregation_strategy is not None:
            raise FinetuneError(
                f"--aggregation-strategy applies to token-classification models, and {model_dir} is a {problem} "
                "model; drop the flag"
            )
        names = config_label_names(config, str(config_file))
        chosen = resolve_activation(activation, problem, cross_encoder_activation(Path(config_file).parent, config))
        if max_length is not None:
            check_max_length(max_length, config.max_sequence_length)
        model_class = (
            BertForTokenClassification if problem is ProblemType.TOKEN_CLASSIFICATION else BertForSequenceClassification
        )
        model = model_class.from_pretrained(model_dir, quantization=quantization).to(where)
        tokenizer = load_tokenizer(model.source_dir)
        # Not the training run's max_length: transformers' pipeline and CrossEncoder read up to this limit.
        limit = min(tokenizer.truncation["max_length"], config.max_sequence_length)
        strategy = aggregation_strategy or "first"
        found = (model, tokenizer, problem, names, max_length or limit, where, chosen)
        return cls(*found, aggregation_strategy=strategy, **options)

    @property
    def tagger(self) -> bool:
        return self.problem is ProblemType.TOKEN_CLASSIFICATION

    def __call__(self, texts: Sequence, pairs: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """One row per text (a tagger also takes lists of words); `pairs`: second segments."""
        if isinstance(texts, str):
            raise TypeError("texts must be a list of texts, not one string; pass [text]")
        threads = self.threads if self.device.type == "cpu" else None
        if self.tagger:
            if pairs is not None:
                raise FinetuneError("a token classifier tags single texts; drop the pairs")
            return self._tag(list(texts), threads)
        check_max_length(self.max_length, self.model.config.max_sequence_length, pairs=pairs is not None)
        dataset = TextDataset(texts=list(texts), pairs=list(pairs) if pairs is not None else None)
        with governed(self.model, threads):
            scores = predict_scores(
                self.model, self.tokenizer, dataset, self.batch_size, self.max_length, self.device, self.bf16
            )
        if self.activation == "sigmoid":
            scores = scores.sigmoid()
        self.truncated = count_truncated(self.tokenizer, dataset, self.max_length)
        return [self.problem.prediction(self.names, row, self.threshold) for row in scores.tolist()]

    def _tag(self, inputs: list, threads) -> list[dict[str, Any]]:
        from ..entities import aggregate, decoder_of

        with governed(self.model, threads):
            scored = predict_tokens(
                self.model, self.tokenizer, inputs, self.batch_size, self.max_length, self.device, self.bf16
            )
        decode = decoder_of(self.tokenizer)
        self.truncated = sum(s.truncated for s in scored)
        return [
            ({} if isinstance(x, str) else {"text": s.text})
            | {"entities": aggregate(s, self.aggregation_strategy, self.names, decode)}
            for x, s in zip(inputs, scored)
        ]

    def summary(self, rows: list[dict[str, Any]]) -> str:
        """What the rows came to, in a few words, with a note of the inputs cut at `max_length`."""
        if self.tagger:
            cut = f"; {self.truncated} text(s) cut at {self.max_length} tokens, untagged past the cut"
        else:
            cut = f"; {self.truncated} row(s) longer than {self.max_length} tokens, read up to the cut"
        return self.problem.summary(self.names, rows) + (cut if self.truncated else "")


def classifier_config(model_dir: str | os.PathLike) -> tuple[BertConfig, Path]:
    """The model's config and its file; default labels (LABEL_i) where transformers 5 wrote
    none, as its pipeline reads them; a `ConfigError` for a model that is no classifier."""
    config_file = locate_checkpoint(model_dir).config_file
    config = BertConfig.from_json_file(config_file)
    sequence_classifier = any(
        str(a).endswith("ForSequenceClassification") for a in config.extra.get("architectures") or ()
    )
    if not config.id2label and sequence_classifier:
        config.id2label = {i: f"LABEL_{i}" for i in range(config.num_labels)}
    if not config.id2label:
        raise ConfigError(
            f"{model_dir} has no id2label in its config.json: it is not a fine-tuned classifier. "
            "Pass the output directory of bert-port-finetune"
        )
    return config, config_file


def check_quantization(quantization: str | None, device: torch.device, bf16: bool) -> None:
    """int8 runs on the CPU in float32: refused with bf16 or on another device."""
    if quantization and device.type != "cpu":
        raise FinetuneError(f"--quantization {quantization} runs on the CPU, not on {device}: pass --device cpu")
    if quantization and bf16:
        raise FinetuneError(f"--quantization {quantization} runs in float32 between its int8 matmuls: drop --bf16")


def count_truncated(tokenizer, dataset: TextDataset, max_length: int, chunk: int = 512) -> int:
    """How many texts (or pairs) of `dataset` have more than `max_length` tokens."""
    cut = 0
    for start in range(0, len(dataset.texts), chunk):
        pairs = dataset.pairs[start : start + chunk] if dataset.pairs is not None else None
        batch = encode(tokenizer, dataset.texts[start : start + chunk], pairs, max_length=max_length)
        cut += sum(bool(e.overflowing) for e in batch.encodings)
    return cut


def cross_encoder_activation(model_dir: Path, config: BertConfig) -> str | None:
    """The activation a sentence-transformers CrossEncoder saved with this checkpoint, where
    its releases keep it: `config_sentence_transformers.json` (6.x), config.json's
    `sentence_transformers` (4.x, 5.x), `sbert_ce_default_activation_function` (older)."""
    try:
        st_config = json.loads(bounded.read_text(model_dir / ST_MODEL_CONFIG, bounded.JSON, folder=False))
    except (FileNotFoundError, ValueError):
        st_config = {}
    in_config = config.extra.get("sentence_transformers")
    for found in (
        st_config.get("activation_fn") if isinstance(st_config, dict) else None,
        in_config.get("activation_fn") if isinstance(in_config, dict) else None,
        config.extra.get("sbert_ce_default_activation_function"),
    ):
        if found is not None:
            return found
    return None


def resolve_activation(asked: str, problem: ProblemType, saved: str | None) -> str:
    """'none' or 'sigmoid': what `asked` comes to for a model of `problem`; 'auto' follows the
    CrossEncoder activation `saved` with the checkpoint, as `CrossEncoder.predict` does, else none."""
    if asked not in ACTIVATIONS:
        raise FinetuneError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {asked!r}")
    if problem is not ProblemType.REGRESSION:
        if asked != "auto":
            raise FinetuneError(
                f"--activation {asked} is for regression (score) models, and this one is {problem}: its outputs are "
                "already probabilities. Drop --activation"
            )
        return "none"
    if asked != "auto":
        return asked
    if saved is not None and saved not in _ST_ACTIVATIONS:
        raise FinetuneError(
            f"the checkpoint's CrossEncoder activation is {saved!r}, which this command does not apply (it applies "
            "Sigmoid and Identity); pass --activation none or --activation sigmoid"
        )
    return _ST_ACTIVATIONS.get(saved, "none")

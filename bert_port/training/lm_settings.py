"""The settings of `bert-port-pretrain`: the options every recipe shares
(`settings.TrainingSettings`) and the language model's, declared as the fine-tuning settings
are (`settings.option`), so that the same code makes the flags, checks them and keeps a
resumed run's settings.

The model is the bundled all-MiniLM-L6-v2 by default, another `--checkpoint`, or a new one
built from `--config` (a config in `configs/`, by name, or a config.json path) with
`--tokenizer`'s vocabulary (by default the bundled one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..assets import config_dir, config_path
from .lm_data import OBJECTIVES
from .masking import MLM_PROBABILITY
from .settings import FinetuneError, TrainingSettings, option

LM_DATASETS = ("mr", "sms")  # the bundled splits whose texts a language model can read


@dataclass
class PretrainConfig(TrainingSettings):
    """The settings of `bert-port-pretrain`."""

    command: ClassVar[str] = "bert-port-pretrain"
    kind: ClassVar[str] = "language-model training"
    data_formats: ClassVar[str] = "TXT, one text per line, or JSONL, CSV, TSV"
    recipe_prefix: ClassVar[str] = "pretrain_"

    # The model and its objective.
    objective: str = option(
        "mlm",
        "mlm: masked LM (BertForMaskedLM, BERT's objective); clm: causal LM, next-token loss (BertLMHeadModel)",
        choices=OBJECTIVES,
        resume=True,
    )
    config: str | None = option(
        None,
        "train a new model from scratch: a config in configs/ by name (bert-mini-lm, bert-base-uncased, ...) or a "
        "config.json path; excludes --checkpoint",
        resume=True,
    )
    tokenizer: str | None = option(
        None,
        "folder with the tokenizer files (tokenizer.json or vocab.txt); default: the checkpoint's, or the bundled "
        "all-MiniLM-L6-v2's for --config",
        resume=True,
    )
    reference: str = option(
        "port",
        "'port': bert_port's model; 'hf': transformers' BertForMaskedLM / BertLMHeadModel, same loop, initial "
        "weights and masks",
        choices=("port", "hf"),
        resume=True,
    )
    # The data.
    dataset: str | None = option(
        None,
        "bundled texts instead of files: mr (the movie-review sentences of the mr split: train, and validation "
        "for --validation), sms (SMS messages, likewise)",
        choices=LM_DATASETS,
        resume=True,
    )
    train: str | None = option(
        None, "training texts: .txt (one text per line), or the --text-column of .jsonl, .csv or .tsv", resume=True
    )
    block_size: int = option(
        128,
        "tokens per block: the texts, tokenized whole, are concatenated and cut into blocks this long (run_clm's "
        "group_texts)",
        resume=True,
        least=2,
    )
    mlm_probability: float = option(
        MLM_PROBABILITY,
        "mlm: the share of tokens chosen; 80%% of them become [MASK], 10%% a random token, 10%% stay",
        resume=True,
        lo=0.0,
        hi=1.0,
        lo_open=True,
        want="strictly between 0 and 1",
    )
    whole_word_mask: bool = option(
        False, "mlm: choose whole words (a word's ## pieces with it), every token of a chosen one [MASK]", resume=True
    )
    eval_batch_size: int = option(16, "evaluation batch (blocks) per process", least=1)
    output_dir: str = option(
        "runs/pretrain", "where the best checkpoint (HF format), metrics.json, curves and resume state go"
    )

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.checkpoint is not None and self.config is not None:
            problems.append(
                "give either --checkpoint (train a model further) or --config (a new one from scratch), not both"
            )
        if self.whole_word_mask is True and self.objective == "clm":
            problems.append("--whole-word-mask is a masking option: it needs --objective mlm")
        return problems


def model_config_path(name: str) -> Path:
    """The config.json `--config NAME` names: a path, or a config bundled in `configs/`."""
    path = Path(name)
    if path.is_file():
        return path
    bundled = config_path(name)
    if path.parent == Path(".") and bundled.is_file():
        return bundled
    known = sorted(p.stem for p in config_dir().glob("*.json") if not p.name.startswith(("finetune_", "pretrain_")))
    raise FinetuneError(
        f"--config {name}: no such file, and no model config of that name in configs/ ({', '.join(known)}); "
        "pass a config.json path or one of those names"
    )

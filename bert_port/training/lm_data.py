"""The text of a language-model run, prepared as transformers' run_clm.py / run_mlm.py do,
its batches, and the loss of each block.

Texts. A `.txt` file holds one text per line (blank lines skipped); `.jsonl`, `.csv` and
`.tsv` hold one per row, in `--text-column` (`data.load_texts`); `--dataset mr|sms` takes the
texts of a bundled split. Without `--validation`, `--validation-split` of the texts is held
out (seeded; run_clm takes the first N% instead).

Blocks, following run_clm's `tokenize_function` and `group_texts`:
  - each text is tokenized once, whole (no truncation), with the tokenizer's [CLS] and [SEP];
  - the texts are concatenated and cut into blocks of `block_size` tokens, and the remainder
    that does not fill a block is dropped, within each group of 1,000 texts
    (`GROUP_TEXTS_BATCH`, the batch of run_clm's `datasets.map(..., batched=True)`), as
    run_clm does; a group too short for one block gives none;
  - every block is full, so its attention mask is all ones and its token types all zeros.
The causal LM's labels are the block itself (the model shifts them); the masked LM's come
from `masking.Masking`.

Shapes: N blocks, B a batch of them, T = `block_size`, V the vocabulary.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data import DataError, TextDataset, builtin_splits, load_texts, validation_split
from ..losses import IGNORE_INDEX
from .masking import Masking, block_seed

log = logging.getLogger(__name__)

GROUP_TEXTS_BATCH = 1000  # datasets.map's default batch_size: run_clm groups every 1,000 texts apart
OBJECTIVES = ("clm", "mlm")


def read_text_file(path: str | Path, text_column: str = "text") -> TextDataset:
    """The texts of a `.txt` file (one per line, blank lines skipped), or of the `text_column`
    of a `.jsonl`, `.csv` or `.tsv` file. A missing, unreadable or textless file is a `DataError`."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a text file; pass a .txt file (one text per line) or .jsonl")
    if path.suffix.lower() != ".txt":
        return load_texts(path, text_column=text_column, label_column=None)
    try:
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except FileNotFoundError:
        raise DataError(f"text file {path} does not exist; check the path given to --train/--validation") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 ({exc}); re-save it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
    rows = [(n, line.removesuffix("\r")) for n, line in enumerate(lines, start=1) if line.strip()]
    if not rows:
        raise DataError(f"{path} holds no text; a .txt file holds one text per line")
    return TextDataset(texts=[t for _, t in rows], source=str(path), rows=[n for n, _ in rows])


def load_lm_texts(cfg) -> tuple[TextDataset, TextDataset]:
    """(training texts, validation texts) of a `PretrainConfig`."""
    if cfg.dataset is not None:
        parts = builtin_splits(cfg.dataset)
        train, validation = parts["train"], parts["validation"]
    else:
        train = read_text_file(cfg.train, cfg.text_column)
        if cfg.validation is not None:
            validation = read_text_file(cfg.validation, cfg.text_column)
        else:
            train, validation = validation_split(train, cfg.validation_split, cfg.seed)
    if cfg.max_train_examples is not None:
        train = train.subset(range(min(cfg.max_train_examples, len(train))))
    return train, validation


def group_texts(sequences: list[list], block_size: int) -> list[list]:
    """run_clm's `group_texts` on one batch of texts: concatenated, cut into blocks of
    `block_size`, the remainder dropped."""
    concatenated = list(chain(*sequences))
    total = (len(concatenated) // block_size) * block_size
    return [concatenated[i : i + block_size] for i in range(0, total, block_size)]


@dataclass
class Blocks:
    """The blocks of one split: `input_ids` (N, T) and each token's character `offsets`
    (N, T, 2) within its text (for whole-word masking); `texts` texts gave them, `tokens`
    is N x T."""

    input_ids: Tensor
    offsets: Tensor
    texts: int
    tokens: int
    source: str = ""

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def make_blocks(tokenizer, dataset: TextDataset, block_size: int, split: str) -> Blocks:
    """Tokenize every text of `dataset` once (whole) and group the tokens into blocks
    (see the module docstring). No block at all is a `DataError`."""
    tokenizer.no_truncation()  # run_clm tokenizes whole texts; blocks cut them
    ids, offsets = [], []
    for start in range(0, len(dataset), GROUP_TEXTS_BATCH):
        encodings = tokenizer.encode_batch(dataset.texts[start : start + GROUP_TEXTS_BATCH])
        ids += group_texts([e.ids for e in encodings], block_size)
        offsets += group_texts([e.offsets for e in encodings], block_size)
    if not ids:
        counted = sum(len(e.ids) for e in tokenizer.encode_batch(dataset.texts))
        raise DataError(
            f"{dataset.source}: the {split} texts ({len(dataset)}) make {counted} tokens, fewer than one block of "
            f"--block-size {block_size} in each group of {GROUP_TEXTS_BATCH} texts; use a smaller --block-size or "
            "more text"
        )
    return Blocks(
        input_ids=torch.tensor(ids, dtype=torch.long),
        offsets=torch.tensor(offsets, dtype=torch.long),
        texts=len(dataset),
        tokens=len(ids) * block_size,
        source=dataset.source,
    )


@dataclass
class LMSplits:
    """A language-model run's data. `names` is the label map of a classifier's run: a
    language model has none, so its resumable state records an empty one."""

    train: Blocks
    validation: Blocks
    names: list[str] = field(default_factory=list)
    test: None = None


class BlockCollator:
    """Turns block indices into a model batch: `input_ids`, `attention_mask` (ones),
    `token_type_ids` (zeros), `labels`, each (B, T), and `index` (B,). With `masking` (the
    masked LM) each block is masked by its own generator, seeded by (seed, `stream`,
    epoch, block): the same masks whatever the batch, process or model."""

    def __init__(self, blocks: Blocks, masking: Masking | None, seed: int, stream: str):
        self.blocks, self.masking, self.seed, self.stream = blocks, masking, seed, stream

    def __call__(self, indices: list[int], epoch: int = 0) -> dict[str, Tensor]:
        index = torch.tensor(list(indices), dtype=torch.long)
        input_ids = self.blocks.input_ids[index]
        if self.masking is None:
            labels = input_ids.clone()  # the causal LM's: shifted inside the loss
        else:
            rows = [
                self.masking(
                    input_ids[i : i + 1],
                    torch.Generator().manual_seed(block_seed(self.seed, self.stream, epoch, block)),
                    self.blocks.offsets[block : block + 1],
                )
                for i, block in enumerate(index.tolist())
            ]
            input_ids = torch.cat([inputs for inputs, _ in rows])
            labels = torch.cat([row_labels for _, row_labels in rows])
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "token_type_ids": torch.zeros_like(input_ids),
            "labels": labels,
            "index": index,
        }


def _targets(logits: Tensor, labels: Tensor, objective: str) -> tuple[Tensor, Tensor]:
    """The (B, T', V) logits and (B, T') labels that are scored: the causal LM's logits at t
    against the token at t + 1 (transformers' `ForCausalLMLoss` shift), the masked LM's as they are."""
    if objective == "clm":
        return logits[:, :-1], labels[:, 1:]
    return logits, labels


def token_losses(logits: Tensor, labels: Tensor, objective: str) -> Tensor:
    """Each block's summed token cross-entropy, (B,), -100 labels left out: divided by the
    number of targets (`target_count`) it is transformers' BertLMHeadModel / BertForMaskedLM loss."""
    logits, labels = _targets(logits, labels, objective)
    scored = labels != IGNORE_INDEX
    losses = torch.zeros(labels.shape, dtype=logits.dtype, device=logits.device)
    # Only the scored rows go through the softmax: 15% of them for the masked LM.
    losses[scored] = F.cross_entropy(logits[scored], labels[scored], reduction="none")
    return losses.sum(-1)


def target_count(labels: Tensor, objective: str) -> Tensor:
    """The number of scored tokens of each block, (B,)."""
    if objective == "clm":
        labels = labels[:, 1:]
    return (labels != IGNORE_INDEX).sum(-1)


def loss_function(objective: str):
    """`token_losses` for `objective`, as `steps.train_step`'s `loss_fn(logits, labels)`."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; use one of {', '.join(OBJECTIVES)}")
    return functools.partial(token_losses, objective=objective)

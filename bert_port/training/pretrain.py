"""The language-model recipe behind `bert-port-pretrain`: `PretrainRecipe`, the fine-tuning
recipe (`recipe.FinetuneRecipe`) with a language model's model, data, loss and evaluation.

Everything else is the fine-tuning recipe's own code, unchanged: processes and torchrun
(DDP), the global batch split over accumulation and processes, AdamW and the schedules,
bf16/fp16, the NaN stop, the output folder and its lock, staged writes, ENOSPC, Ctrl-C, the
resumable state and its bit-identical continuation, TensorBoard, metrics.json and the plot.

What differs:
  - the model: `BertForMaskedLM` (`--objective mlm`) or `BertLMHeadModel` (`clm`, with
    `is_decoder=True`), from a checkpoint or new from a config; with `--reference hf` its
    transformers twin, from the same initial weights;
  - the data: blocks of `--block-size` tokens (`lm_data`), masked per block (`masking`);
  - the loss: each block's summed token cross-entropy, divided by the number of target
    tokens in the global step (summed over the processes), so a step's loss is
    transformers' mean over its tokens however the step is split;
  - evaluation: the validation loss (mean token cross-entropy, masks fixed for the run) and
    its perplexity, once before the first step and then as the fine-tuning recipe's
    (`--eval-steps`, or every epoch); the best (lowest loss) is saved in HF format.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import checkpoint as ckpt
from ..assets import minilm_dir
from ..config import BertConfig
from ..heads import BertForMaskedLM, BertLMHeadModel
from ..metrics import require_items
from ..reference import hf_twin
from ..tokenization import SPECIAL_TOKENS, load_tokenizer
from .api import run_recipe
from .batching import chunks
from .data_signal import check_blocks
from .lm_data import BlockCollator, LMSplits, load_lm_texts, loss_function, make_blocks, target_count, token_losses
from .lm_settings import PretrainConfig, model_config_path
from .masking import Masking
from .recipe import FinetuneRecipe
from .reporting import full_disk_said, resolved_config, write_json
from .run_folder import RESOLVED_CONFIG
from .settings import FinetuneError
from .steps import Dist, ResumableSampler, autocast, set_seed

log = logging.getLogger(__name__)

__all__ = ["PretrainRecipe", "evaluate_lm", "pretrain"]

MODELS = {"mlm": BertForMaskedLM, "clm": BertLMHeadModel}


def perplexity(loss: float) -> float:
    """exp(loss), infinite where it overflows, as run_clm / run_mlm report it."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def evaluate_lm(
    model: nn.Module, collate: BlockCollator, objective: str, dist_info: Dist, batch_size: int, **precision: bool
) -> dict[str, Any]:
    """The mean token cross-entropy (`loss`) over the blocks of `collate` and its
    `perplexity`, split over the processes (each takes every W-th block); `tokens` scored,
    `n` blocks. `precision`: `bf16`, `fp16` autocast."""
    was_training = model.training
    model.eval()
    device = dist_info.device
    order = list(range(len(collate.blocks)))[dist_info.rank :: dist_info.world_size]
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, tokens
    for indices in tqdm(list(chunks(order, batch_size)), desc="validation", leave=False, disable=not dist_info.is_main):
        batch = {k: v.to(device) for k, v in collate(indices).items()}
        with autocast(device, **precision):
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
            logits = model(**inputs).logits.float()
        sums[0] += token_losses(logits, batch["labels"], objective).sum().double()
        sums[1] += target_count(batch["labels"], objective).sum().double()
    loss_sum, tokens = dist_info.sum(sums).tolist()
    model.train(was_training)
    require_items(tokens, "target tokens", "the validation loss")
    loss = loss_sum / tokens
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": int(tokens), "n": len(collate.blocks)}


def model_source(cfg: PretrainConfig) -> tuple[BertConfig, Path]:
    """The config of the model to train, and the folder of its tokenizer."""
    if cfg.config is not None:
        config = BertConfig.from_json_file(model_config_path(cfg.config))
        return config, Path(cfg.tokenizer) if cfg.tokenizer else minilm_dir()
    files = ckpt.locate_checkpoint(cfg.checkpoint or minilm_dir())
    return BertConfig.from_json_file(files.config_file), Path(cfg.tokenizer) if cfg.tokenizer else files.directory


def check_model_for(cfg: PretrainConfig, config: BertConfig, tokenizer) -> None:
    """Refuse a model that cannot train on these blocks with this objective and tokenizer."""
    where = f"--config {cfg.config}" if cfg.config else f"the checkpoint {cfg.checkpoint or minilm_dir()}"
    if cfg.block_size > config.max_position_embeddings:
        raise FinetuneError(
            f"--block-size {cfg.block_size} exceeds the max_position_embeddings ({config.max_position_embeddings}) "
            f"of {where}: blocks that long cannot be encoded; use --block-size {config.max_position_embeddings} or less"
        )
    if cfg.objective == "mlm" and config.is_decoder:
        raise FinetuneError(
            f"{where} is a causal model (is_decoder true: each token sees only those before it), which cannot "
            "predict masked tokens from both sides; use --objective clm, or a checkpoint with is_decoder false"
        )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if cfg.config is not None and size < config.vocab_size:
        # A new model's output layer would spread the step-0 loss over ids no text can hold
        # (ln 30,522 on a 117-token vocabulary).
        raise FinetuneError(
            f"the tokenizer has {size} tokens but {where} has vocab_size {config.vocab_size}: a new model would "
            f"predict {config.vocab_size - size} ids the tokenizer never produces; set vocab_size to {size} in the "
            "config, or use a tokenizer of that vocabulary (--tokenizer)"
        )
    if size < config.vocab_size:
        log.warning(
            "the tokenizer has %d tokens and %s has vocab_size %d: ids %d and up never occur in the text",
            size,
            where,
            config.vocab_size,
            size,
        )
    if size > config.vocab_size:
        raise FinetuneError(
            f"the tokenizer has {size} tokens but {where} has vocab_size {config.vocab_size}: its ids would fall "
            "outside the embedding; use a tokenizer of that vocabulary (--tokenizer) or a config with vocab_size "
            f">= {size}"
        )
    if cfg.objective == "mlm" and tokenizer.token_to_id("[MASK]") is None:
        raise FinetuneError("the tokenizer has no [MASK] token, which the masked LM needs; use --objective clm")


def build_lm_model(cfg: PretrainConfig, tokenizer_dir: Path) -> nn.Module:
    """The model to train, in train mode: new weights (`--config`, and a checkpoint's missing
    head) are drawn from the seeded RNG; with `reference == "hf"` transformers' twin holds
    exactly the port model's initial weights."""
    overrides: dict[str, Any] = {"attn_implementation": cfg.attn_implementation}
    if cfg.objective == "clm":
        overrides["is_decoder"] = True
    set_seed(cfg.seed)
    model_class = MODELS[cfg.objective]
    if cfg.config is not None:
        model = model_class(BertConfig.from_json_file(model_config_path(cfg.config), **overrides))
    else:
        model = model_class.from_pretrained(cfg.checkpoint or minilm_dir(), **overrides)
    model.source_dir = tokenizer_dir
    if cfg.reference == "hf":
        model = hf_twin(model, cfg.attn_implementation)  # leaves the RNG where the port model left it
        model.config.use_cache = False  # training needs no KV cache (transformers' decoder builds one by default)
    return model.train()


class PretrainRecipe(FinetuneRecipe):
    """One language-model run, as one process of a torchrun job: `FinetuneRecipe` with the
    model, data, loss and evaluation of `cfg.objective` (see the module docstring)."""

    cfg: PretrainConfig

    @property
    def headline(self) -> tuple[str, ...]:
        return ("perplexity",)

    def _check_task_extras(self) -> None:
        """Loss and perplexity need no package beyond the core."""

    def _read_data(self) -> None:
        cfg = self.cfg
        self.model_config, self.tokenizer_dir = model_source(cfg)
        tokenizer = load_tokenizer(self.tokenizer_dir)
        check_model_for(cfg, self.model_config, tokenizer)
        self.masking = None
        if cfg.objective == "mlm":
            special = tuple(i for t in SPECIAL_TOKENS if (i := tokenizer.token_to_id(t)) is not None)
            self.masking = Masking(
                mask_id=tokenizer.token_to_id("[MASK]"),
                vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
                special_ids=special,
                probability=cfg.mlm_probability,
                whole_word=cfg.whole_word_mask,
            )
        train, validation = load_lm_texts(cfg)
        self.splits = LMSplits(
            train=make_blocks(tokenizer, train, cfg.block_size, "training"),
            validation=make_blocks(tokenizer, validation, cfg.block_size, "validation"),
        )
        for split, blocks in (("training", self.splits.train), ("validation", self.splits.validation)):
            check_blocks(tokenizer, blocks.input_ids, split, blocks.source, masked=cfg.objective == "mlm")

    def _build_model_and_data(self) -> None:
        cfg, d, splits = self.cfg, self.d, self.splits
        self.model = build_lm_model(cfg, self.tokenizer_dir).to(d.device)
        self.source_dir = self.tokenizer_dir
        self.train_collate = BlockCollator(splits.train, self.masking, cfg.seed, "train")
        self.val_collate = BlockCollator(splits.validation, self.masking, cfg.seed, "validation")
        self.test_collate = None
        self.n_train = len(splits.train)
        self.sampler = ResumableSampler(
            range(self.n_train), num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=cfg.seed
        )

    # --- the loss ------------------------------------------------------------------------

    def collate_train(self, epoch: int, indices: list[int]) -> dict[str, torch.Tensor]:
        return self.train_collate(indices, epoch)  # the masks are drawn anew every epoch

    def loss_count(self, batches: list[dict[str, torch.Tensor]], weights: list[torch.Tensor], n_examples: int) -> float:
        """The target tokens of the global step's real blocks, summed over the processes."""
        local = sum(
            (target_count(b["labels"], self.cfg.objective) * w).sum().double() for b, w in zip(batches, weights)
        )
        return max(float(self.d.sum(torch.as_tensor(local, device=self.d.device))), 1.0)

    def loss_options(self) -> dict[str, Any]:
        return {"loss_fn": loss_function(self.cfg.objective)}

    # --- evaluation ----------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """One evaluation before the first step (the model as it starts), then train."""
        if self.global_step == 0 and not self.history["evaluations"]:
            with full_disk_said(self.out, lambda: self.global_step):
                self.evaluate()
        return super().train()

    def _metrics_on(self, model: nn.Module, collate, split: str) -> dict[str, Any]:
        cfg = self.cfg
        return evaluate_lm(model, collate, cfg.objective, self.d, cfg.eval_batch_size, bf16=cfg.bf16, fp16=cfg.fp16)

    # --- what the run writes -------------------------------------------------------------

    def task_summary(self) -> dict[str, Any]:
        return {
            "objective": self.cfg.objective,
            "headline": list(self.headline),
            "loss_name": "token cross-entropy",
        }

    def resolved_config(self) -> dict[str, Any]:
        splits = self.splits
        sizes = {
            split: {"texts": blocks.texts, "blocks": len(blocks), "tokens": blocks.tokens}
            for split, blocks in (("train", splits.train), ("validation", splits.validation))
        }
        return resolved_config(self.cfg, self.shape(), sizes=sizes)

    def _write_run_files(self) -> None:
        cfg, splits = self.cfg, self.splits
        self.out.mkdir(parents=True, exist_ok=True)
        write_json(self.resolved_config(), self.out / RESOLVED_CONFIG)
        log.info(
            "%s: %d train / %d validation blocks of %d tokens (from %d / %d texts); %d step(s) per epoch of %d "
            "blocks (%d per micro-batch x %d accumulation x %d process(es)), %d steps, on %s",
            cfg.objective,
            len(splits.train),
            len(splits.validation),
            cfg.block_size,
            splits.train.texts,
            splits.validation.texts,
            self.steps_per_epoch,
            cfg.batch_size,
            self.micro,
            cfg.grad_accum_steps,
            self.d.world_size,
            self.total_steps,
            self.d.device,
        )

    def metrics(self, status: str) -> dict[str, Any]:
        metrics = super().metrics(status)
        train_time = self.history["train_time_s"]
        tokens = self.history["examples"] * self.cfg.block_size
        metrics["train_tokens_per_s"] = round(tokens / train_time, 1) if train_time else None
        return metrics


def pretrain(cfg: PretrainConfig) -> dict[str, Any]:
    """Run the language-model job `cfg` (under torchrun, as one of its processes). Returns
    the metrics written to `metrics.json`, as `finetune` does."""
    return run_recipe(PretrainRecipe, cfg)

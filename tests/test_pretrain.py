"""bert-port-pretrain: the language-model recipe on real MR sentences with the real MiniLM
tokenizer and a tiny model. The loss curve against transformers' BertForMaskedLM and
BertLMHeadModel trained through the same recipe, the masks against transformers'
DataCollatorForLanguageModeling, the blocks against run_clm's group_texts, resume, torchrun,
the masked LM's checkpoint fine-tuned by bert-port-finetune, and the refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from itertools import chain
from pathlib import Path

import pytest
import torch
from conftest import TINY, TOL, load_last, metrics_of, run_finetune

from bert_port.cli import pretrain as pretrain_cli
from bert_port.data import builtin_splits
from bert_port.tokenization import SPECIAL_TOKENS, load_tokenizer
from bert_port.tolerance import TRAINING_CURVE, TRAINING_CURVE_STEPS
from bert_port.training.lm_data import GROUP_TEXTS_BATCH, BlockCollator, make_blocks, target_count, token_losses
from bert_port.training.masking import Masking, block_seed, mask_tokens, word_ids

REPO = Path(__file__).resolve().parent.parent


def run_pretrain(*args) -> int:
    """`bert-port-pretrain` in this process (its `main`), every argument as a string."""
    return pretrain_cli.main([str(a) for a in args])


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return load_tokenizer(minilm_path)


@pytest.fixture(scope="module")
def masking(tokenizer) -> Masking:
    special = tuple(i for t in SPECIAL_TOKENS if (i := tokenizer.token_to_id(t)) is not None)
    return Masking(tokenizer.token_to_id("[MASK]"), tokenizer.get_vocab_size(True), special)


@pytest.fixture(scope="module")
def mr_blocks(tokenizer):
    """The bundled MR training sentences (8,452) as blocks of 64 tokens."""
    return make_blocks(tokenizer, builtin_splits("mr")["train"], 64, "training")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """MR sentences: 48 training texts as .txt (one per line; 41 blocks of 32), 20 validation
    texts as .jsonl (18 blocks);
    tiny configs (TINY with MiniLM's vocabulary), with and without dropout."""
    root = tmp_path_factory.mktemp("lm")
    splits = builtin_splits("mr")
    (root / "train.txt").write_text("\n".join(splits["train"].texts[:48]) + "\n", encoding="utf-8")
    lines = [json.dumps({"text": t}) for t in splits["validation"].texts[:20]]
    (root / "validation.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for name, dropout in (("tiny", 0.0), ("tiny_dropout", 0.1)):
        config = {**TINY, "vocab_size": 30522, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
        (root / f"{name}.json").write_text(json.dumps(config))
    return {name: root / name for name in ("train.txt", "validation.jsonl", "tiny.json", "tiny_dropout.json")}


def lm_args(files, out, *extra, config="tiny.json") -> list:
    """A short CPU run from scratch on the tiny config: blocks of 32, batches of 8, lr 1e-3."""
    return [
        *("--config", files[config], "--train", files["train.txt"], "--validation", files["validation.jsonl"]),
        *("--output-dir", out, "--block-size", "32", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "2"),
        *("--device", "cpu", "--eval-batch-size", "32"),
        *extra,
    ]


@pytest.fixture
def no_plot(monkeypatch):
    """Runs whose curves PNG no check reads skip drawing it (matplotlib's layout is a third of
    such a tiny run's time); `mlm_run` draws its own."""
    monkeypatch.setattr("bert_port.training.recipe.plot_curves", lambda *args, **kwargs: None)


def losses_of(metrics: dict) -> torch.Tensor:
    return torch.tensor([s["loss"] for s in metrics["steps"]], dtype=torch.float64)


# -----------------------------------------------------------------------------------------
# The loss and its curve, against transformers


@pytest.mark.parametrize("objective, hf_class", [("mlm", "BertForMaskedLM"), ("clm", "BertLMHeadModel")])
def test_recipe_loss_is_transformers_loss(objective, hf_class, tokenizer, masking, mr_blocks):
    """A block batch's summed token losses over its target count is transformers' own loss
    (`model(..., labels=...).loss`) for the same logits and labels."""
    from conftest import hf_model

    config = {**TINY, "vocab_size": 30522, "is_decoder": objective == "clm"}
    model = hf_model(config, hf_class)
    collate = BlockCollator(mr_blocks, masking if objective == "mlm" else None, seed=0, stream="train")
    batch = collate(list(range(8)))
    with torch.no_grad():
        out = model(
            **{k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "labels")}, use_cache=False
        )
    ours = token_losses(out.logits, batch["labels"], objective).sum() / target_count(batch["labels"], objective).sum()
    torch.testing.assert_close(ours, out.loss, **TOL[torch.float32])


@pytest.mark.parametrize("objective", ["mlm", "clm"])
def test_loss_curve_equals_transformers(objective, tmp_path, files, no_plot):
    """20 steps (batches of 4, into a second epoch) from the same initial weights, data order
    and masks: the port's per-step losses
    and its evaluations (step 0 included) equal those of transformers' BertForMaskedLM /
    BertLMHeadModel trained through the same recipe (`--reference hf`), within the policy's
    training-curve tolerance."""
    extra = ("--objective", objective, "--max-steps", TRAINING_CURVE_STEPS, "--eval-steps", "10", "--batch-size", "4")
    assert run_pretrain(*lm_args(files, tmp_path / "port", *extra)) == 0
    hf_extra = ("--reference", "hf", "--compare-to", tmp_path / "port")
    assert run_pretrain(*lm_args(files, tmp_path / "hf", *extra, *hf_extra)) == 0
    port, hf = metrics_of(tmp_path / "port"), metrics_of(tmp_path / "hf")
    name = {"mlm": "BertForMaskedLM", "clm": "BertLMHeadModel"}[objective]
    assert port["name"].startswith(f"bert_port {name}") and hf["name"].startswith(f"transformers {name}")
    diff = (losses_of(port) - losses_of(hf)).abs()
    print(f"{objective}: per-step loss |port - transformers| max {diff.max():.2e} over {len(diff)} steps")
    assert len(diff) == TRAINING_CURVE_STEPS and hf["comparison"]["steps_compared"] == TRAINING_CURVE_STEPS
    torch.testing.assert_close(losses_of(port), losses_of(hf), **TRAINING_CURVE.kwargs())
    assert [e["step"] for e in port["evaluations"]] == [0, 10, 20] == [e["step"] for e in hf["evaluations"]]
    for ours, theirs in zip(port["evaluations"], hf["evaluations"]):
        assert ours["validation"]["tokens"] == theirs["validation"]["tokens"]  # the same fixed masks
        torch.testing.assert_close(ours["validation"]["loss"], theirs["validation"]["loss"], **TRAINING_CURVE.kwargs())
    assert port["evaluations"][-1]["validation"]["loss"] < port["evaluations"][0]["validation"]["loss"]


def test_tied_decoder_is_one_parameter_of_adamw():
    """The MLM decoder's weight is the word embedding and its bias `cls.predictions.bias`:
    AdamW holds each once (as transformers' Trainer, from `named_parameters()`), not twice."""
    from bert_port import BertConfig, BertForMaskedLM
    from bert_port.training.lm_settings import PretrainConfig
    from bert_port.training.steps import build_optimizer

    model = BertForMaskedLM(BertConfig.from_dict({**TINY, "vocab_size": 30522}))
    params = [p for group in build_optimizer(model, PretrainConfig(dataset="mr")).param_groups for p in group["params"]]
    assert len({id(p) for p in params}) == len(params) == len(list(model.parameters()))


# -----------------------------------------------------------------------------------------
# Masking


def _binomial_bound(p: float, n: int, z: float = 4.9) -> float:
    """Half-width of a two-sided binomial interval of about 1e-6 (normal approximation)."""
    return z * math.sqrt(p * (1 - p) / n)


def test_masking_rates_split_and_special_tokens(mr_blocks, masking):
    """Over the MR blocks (about 240,000 tokens): 15% of the non-special tokens chosen, of
    those 80% [MASK], 10% another token, 10% kept, each within a binomial bound; no special
    token is ever chosen or changed."""
    ids = mr_blocks.input_ids
    inputs, labels = masking(ids, torch.Generator().manual_seed(0))
    special = masking.special(ids)
    chosen = labels != -100
    assert not chosen[special].any() and torch.equal(inputs[special], ids[special])
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    n, k = int((~special).sum()), int(chosen.sum())
    assert abs(k / n - 0.15) < _binomial_bound(0.15, n)
    to_mask = inputs[chosen] == masking.mask_id
    kept = inputs[chosen] == ids[chosen]
    changed = ~to_mask & ~kept  # a random token that happens to be the same one counts as kept
    shares = {"[MASK]": (to_mask, 0.8), "random": (changed, 0.1), "kept": (kept, 0.1)}
    print({name: round(float(x.float().mean()), 4) for name, (x, _) in shares.items()}, f"of {k} chosen")
    for name, (hits, p) in shares.items():
        assert abs(float(hits.float().mean()) - p) < _binomial_bound(p, k), name


def test_whole_word_masking_masks_words_whole(mr_blocks, masking, tokenizer):
    """Every word is masked whole or not at all, its ## pieces with it, every chosen token
    [MASK]; the share of words chosen is 15% within a binomial bound."""
    from dataclasses import replace

    whole = replace(masking, whole_word=True)
    ids, offsets = mr_blocks.input_ids[:800], mr_blocks.offsets[:800]
    inputs, labels = whole(ids, torch.Generator().manual_seed(0), offsets)
    chosen = labels != -100
    assert torch.equal(inputs[chosen], torch.full_like(inputs[chosen], masking.mask_id))
    words, starts = word_ids(offsets, masking.special(ids))
    pieces = torch.tensor([tokenizer.id_to_token(int(t)).startswith("##") for t in ids.flatten()]).view(ids.shape)
    # A ## piece never starts a word (but a block may begin in the middle of one).
    assert not (starts & pieces)[:, 1:].any() and pieces[:, 1:].any()
    # Chosen is constant on each word: a token is chosen exactly when its word's first token is.
    first_chosen = torch.zeros(ids.shape[0], ids.shape[1] + 1, dtype=torch.bool)
    first_chosen.scatter_(1, torch.where(starts, words, ids.shape[1]), chosen & starts)
    in_word = words >= 0
    assert torch.equal(chosen[in_word], first_chosen.gather(1, words.clamp(min=0))[in_word])
    assert not chosen[~in_word].any()
    n = int(starts.sum())
    assert abs(float((chosen & starts).sum()) / n - 0.15) < _binomial_bound(0.15, n)


@pytest.mark.parametrize("whole_word", [False, True])
def test_masks_equal_transformers_collator(whole_word, mr_blocks, masking, minilm_path):
    """On the same generator draws, `mask_tokens` gives transformers' DataCollatorForLanguageModeling
    (transformers' tokenizer, `seed`, `whole_word_mask`, offsets as `offset_mapping`) its inputs and
    labels bit for bit: on a batch of 64 blocks, and on one block seeded as the recipe seeds it."""
    import warnings
    from dataclasses import replace

    import transformers

    ours = replace(masking, whole_word=whole_word)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path))
    for rows, seed in ((slice(0, 64), 7), (slice(5, 6), block_seed(42, "train", 1, 5))):
        ids, offsets = mr_blocks.input_ids[rows], mr_blocks.offsets[rows]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # whole words: "random token replacement is not supported"
            collator = transformers.DataCollatorForLanguageModeling(
                hf_tok, mlm_probability=0.15, whole_word_mask=whole_word, seed=seed
            )
        expected = collator([{"input_ids": r.tolist(), "offset_mapping": o.tolist()} for r, o in zip(ids, offsets)])
        inputs, labels = mask_tokens(ids, ours.special(ids), torch.Generator().manual_seed(seed), ours, offsets)
        assert torch.equal(inputs, expected["input_ids"]) and torch.equal(labels, expected["labels"])
    collate = BlockCollator(mr_blocks, ours, seed=42, stream="train")
    assert torch.equal(collate([5], epoch=1)["input_ids"], inputs)  # the recipe's block 5 in epoch 1


def test_masks_depend_on_seed_epoch_and_block_only(mr_blocks, masking):
    train = BlockCollator(mr_blocks, masking, seed=1, stream="train")
    alone = train([7], epoch=2)
    together = train([3, 7, 11], epoch=2)
    assert torch.equal(together["input_ids"][1], alone["input_ids"][0])
    assert torch.equal(together["labels"][1], alone["labels"][0])
    assert not torch.equal(train([7], epoch=3)["labels"], alone["labels"])  # new masks each epoch
    validation = BlockCollator(mr_blocks, masking, seed=1, stream="validation")
    assert torch.equal(validation(list(range(20)))["labels"], validation(list(range(20)))["labels"])


# -----------------------------------------------------------------------------------------
# Blocks


def run_clm_group_texts(examples: dict[str, list], block_size: int) -> dict[str, list]:
    """transformers' examples/pytorch/language-modeling/run_clm.py `group_texts`, as written
    there (the too-short-batch branch aside), applied below to each batch of 1,000 texts as
    run_clm's `datasets.map(group_texts, batched=True)` does."""
    concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
    total_length = len(concatenated_examples[list(examples.keys())[0]])  # noqa: RUF015 (run_clm's words)
    total_length = (total_length // block_size) * block_size
    result = {
        k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated_examples.items()
    }
    result["labels"] = result["input_ids"].copy()
    return result


@pytest.mark.parametrize("n_texts, block_size", [(7, 16), (2500, 128)])
def test_blocks_equal_run_clm_group_texts(n_texts, block_size, tokenizer, minilm_path):
    """run_clm's pipeline: transformers' tokenizer on each text (its [CLS] and [SEP] included,
    no truncation), then group_texts per batch of 1,000 texts, remainders dropped."""
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path))
    texts = builtin_splits("mr")["train"].subset(range(n_texts))
    expected = []
    for start in range(0, n_texts, GROUP_TEXTS_BATCH):
        tokenized = hf_tok(texts.texts[start : start + GROUP_TEXTS_BATCH])
        expected += run_clm_group_texts(dict(tokenized), block_size)["input_ids"]
    blocks = make_blocks(tokenizer, texts, block_size, "training")
    assert blocks.input_ids.tolist() == expected
    assert blocks.input_ids.shape == (len(expected), block_size) and blocks.tokens == len(expected) * block_size


# -----------------------------------------------------------------------------------------
# Resume, torchrun, the checkpoint fine-tuned


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory, files) -> Path:
    """An uninterrupted masked-LM run with dropout on: 2 epochs of 6 steps (41 blocks of 32,
    batches of 8), evaluated every 5 steps, TensorBoard on."""
    out = tmp_path_factory.mktemp("mlm") / "full"
    extra = ("--epochs", "2", "--eval-steps", "5", "--report-to", "tensorboard")
    assert run_pretrain(*lm_args(files, out, *extra, config="tiny_dropout.json")) == 0
    return out


def test_metrics_hold_loss_and_perplexity_from_step_0(mlm_run):
    m = metrics_of(mlm_run)
    assert m["status"] == "completed" and m["objective"] == "mlm"
    assert m["global_step"] == 12 and [e["step"] for e in m["evaluations"]] == [0, 5, 10, 12]
    for e in m["evaluations"]:
        assert e["validation"]["perplexity"] == pytest.approx(math.exp(e["validation"]["loss"]))
    assert m["evaluations"][0]["train_loss"] is None
    assert m["best"]["metric"] == "loss" and (mlm_run / "config.json").is_file()
    assert list((mlm_run / "tensorboard").iterdir()) and (mlm_run / "training_curves.png").is_file()


def test_stop_and_resume_ends_bit_identical(tmp_path, files, mlm_run, no_plot):
    """Stopped after 8 steps (in epoch 2, whose masks differ from epoch 1's), then resumed:
    the same per-step losses, evaluations and weights as the uninterrupted run, bit for bit."""
    extra = ("--epochs", "2", "--eval-steps", "5", "--report-to", "tensorboard")
    args = lm_args(files, tmp_path / "split", *extra, config="tiny_dropout.json")
    assert run_pretrain(*args, "--stop-after-steps", "8") == 0
    assert metrics_of(tmp_path / "split")["status"] == "stopped"
    assert run_pretrain(*args, "--resume") == 0
    full, resumed = metrics_of(mlm_run), metrics_of(tmp_path / "split")
    assert full["config"]["steps_per_epoch"] < 8 < full["global_step"]
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in full["steps"]]
    assert [e["validation"] for e in resumed["evaluations"]] == [e["validation"] for e in full["evaluations"]]
    weights, reference = load_last(tmp_path / "split")["model"], load_last(mlm_run)["model"]
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def test_masked_lm_checkpoint_fine_tunes_as_a_classifier(tmp_path, mlm_run, minilm_path):
    """The masked LM's saved checkpoint loads in transformers' BertForMaskedLM with nothing
    missing or unexpected, and is a start for bert-port-finetune."""
    import transformers

    _, info = transformers.BertForMaskedLM.from_pretrained(str(mlm_run), output_loading_info=True)
    assert not any(info.values()), info
    splits = builtin_splits("mr")
    from bert_port.data import write_texts

    write_texts(splits["train"].subset(range(24)), tmp_path / "train.csv")
    write_texts(splits["validation"].subset(range(16)), tmp_path / "validation.csv")
    out = tmp_path / "classifier"
    args = ["--checkpoint", mlm_run, "--train", tmp_path / "train.csv", "--validation", tmp_path / "validation.csv"]
    args += ["--output-dir", out, "--max-length", "16", "--batch-size", "8", "--epochs", "1", "--device", "cpu"]
    assert run_finetune(*args) == 0
    m = metrics_of(out)
    assert m["status"] == "completed" and m["global_step"] == 3 and m["labels"] == ["negative", "positive"]


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(tmp_path, files, no_plot):
    """The same global batch of 8 blocks: torchrun with 2 gloo processes of 4 (and one process
    accumulating 2 micro-batches) give one process's losses, evaluations and weights. 41
    blocks: the last step of each epoch holds 1, and the second process a padding repeat."""
    extra = ("--max-steps", "16", "--eval-steps", "8")
    assert run_pretrain(*lm_args(files, tmp_path / "one", *extra)) == 0
    assert run_pretrain(*lm_args(files, tmp_path / "accum", *extra, "--grad-accum-steps", "2")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "bert_port.cli.pretrain", *map(str, lm_args(files, tmp_path / "ddp", *extra))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = metrics_of(tmp_path / "one")
    assert len(one["steps"]) == 16 and one["config"]["sizes"]["train"]["blocks"] == 41
    for other in ("accum", "ddp"):
        m = metrics_of(tmp_path / other)
        assert m["config"]["world_size"] == (2 if other == "ddp" else 1)
        print(f"{other} vs one process: step-loss |diff| max {(losses_of(m) - losses_of(one)).abs().max():.2e}")
        torch.testing.assert_close(losses_of(m), losses_of(one), atol=1e-5, rtol=1e-5)
        for a, b in zip(m["evaluations"], one["evaluations"], strict=True):
            assert a["validation"]["tokens"] == b["validation"]["tokens"]
            assert abs(a["validation"]["loss"] - b["validation"]["loss"]) < 1e-5
        weights, reference = load_last(tmp_path / other)["model"], load_last(tmp_path / "one")["model"]
        for key, value in reference.items():
            torch.testing.assert_close(weights[key], value, atol=1e-5, rtol=1e-4, msg=lambda s, k=key: f"{k}: {s}")


# -----------------------------------------------------------------------------------------
# Refusals: one line, exit 2, before any training


def _decoder_checkpoint(root: Path, minilm_path: Path) -> Path:
    from bert_port import BertConfig, BertLMHeadModel

    model = BertLMHeadModel(BertConfig.from_dict({**TINY, "vocab_size": 30522, "is_decoder": True}))
    model.source_dir = minilm_path
    return model.save_pretrained(root / "decoder")


SETTINGS_CASES = ("probability_0", "probability_1", "both_models", "whole_word_clm")  # listed under one heading


def _bad_args(case: str, files, bad: Path, out: Path, minilm_path: Path) -> list:
    if case == "decoder_for_mlm":  # a checkpoint instead of --config
        args = lm_args(files, out)
        i = args.index("--config")
        return [*args[:i], *args[i + 2 :], "--checkpoint", _decoder_checkpoint(bad, minilm_path)]
    extra = {
        "empty": ("--train", bad / "empty.txt"),
        "directory": ("--train", bad),
        "missing": ("--train", bad / "nope.txt"),
        "bad_jsonl": ("--validation", bad / "bad.jsonl"),
        "block_size": ("--block-size", "128"),
        "too_short": ("--validation", bad / "short.txt", "--block-size", "64"),
        "vocab": ("--config", bad / "small_vocab.json"),
        "probability_0": ("--mlm-probability", "0"),
        "probability_1": ("--mlm-probability", "1.5"),
        "both_models": ("--checkpoint", minilm_path),
        "whole_word_clm": ("--objective", "clm", "--whole-word-mask"),
        "unknown_config": ("--config", "bert-nano"),
        "diverged": ("--lr", "1e30", "--max-grad-norm", "0", "--max-steps", "3"),
    }[case]
    return lm_args(files, out, *extra)


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", "holds no text; a .txt file holds one text per line"),
        ("directory", "is a directory, not a text file"),
        ("missing", "does not exist; check the path given to --train"),
        ("bad_jsonl", "line 2: not valid JSON"),
        ("block_size", "--block-size 128 exceeds the max_position_embeddings (64)"),
        ("too_short", "fewer than one block of --block-size 64"),
        ("decoder_for_mlm", "is a causal model (is_decoder true"),
        ("vocab", "the tokenizer has 30522 tokens but --config"),
        ("probability_0", "--mlm-probability must be strictly between 0 and 1, got 0.0"),
        ("probability_1", "--mlm-probability must be strictly between 0 and 1, got 1.5"),
        ("both_models", "give either --checkpoint"),
        ("whole_word_clm", "--whole-word-mask is a masking option: it needs --objective mlm"),
        ("unknown_config", "--config bert-nano: no such file, and no model config of that name in configs/"),
        ("diverged", "nothing was saved"),
    ],
)
def test_bad_inputs_are_refused_with_exit_2(case, message, tmp_path, files, minilm_path, capsys):
    """Each refusal is an `error:` line (settings problems: a heading and their list), exit 2,
    no traceback; all but the diverged run stop before the first evaluation."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "empty.txt").write_text("\n  \n", encoding="utf-8")
    (bad / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n', encoding="utf-8")
    (bad / "short.txt").write_text("a short text\n", encoding="utf-8")
    (bad / "small_vocab.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    assert run_pretrain(*_bad_args(case, files, bad, out, minilm_path)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err, err
    if case == "diverged":  # after the progress bars of its steps
        assert "error: step 3 (epoch 1, lr 1e+30) diverged: the gradient norm is " in err
        return
    if case in SETTINGS_CASES:
        assert err.startswith("error: invalid language-model training configuration:\n  - ")
    else:
        assert err.startswith("error: ") and "\n" not in err
    assert not (out / "metrics.json").exists()

"""The fine-tuning recipe's options, end to end on a tiny random BERT with the real MiniLM
tokenizer: --eval-steps, --early-stopping-patience, --lr-scheduler-type, --report-to
tensorboard, fp16's refusal on the CPU, --config by bundled name, the settings dataclass
that generates the flags and the resume checks, and a resume after an interruption that
ends bit-identical with evaluations every N steps and early stopping."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, finetune_args, load_last, metrics_of, run_finetune, tiny_checkpoint

from bert_port import BertConfig, BertModel
from bert_port.cli import finetune as finetune_cli
from bert_port.data import builtin_splits, write_texts
from bert_port.training import FinetuneConfig, load_config_file
from bert_port.training.settings import bundled_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, minilm_path) -> Path:
    """A tiny random BERT (dropout on: the restored RNG state matters on resume)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"), minilm_path)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """37 SMS training messages; validation of 16 ham and 8 spam."""
    root = tmp_path_factory.mktemp("sms")
    splits = builtin_splits("sms")
    val = splits["validation"]
    ham = [i for i, label in enumerate(val.labels) if label == "ham"][:16]
    spam = [i for i, label in enumerate(val.labels) if label == "spam"][:8]
    return {
        "train": write_texts(splits["train"].subset(range(37)), root / "train.csv"),
        "validation": write_texts(val.subset(sorted(ham + spam)), root / "validation.csv"),
    }


# -----------------------------------------------------------------------------------------
# --eval-steps, --early-stopping-patience


def test_eval_steps_evaluates_and_keeps_the_best_every_n_steps(tmp_path, data, ckpt):
    out = tmp_path / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--eval-steps", "3", "--metric-for-best", "loss")) == 0
    m = metrics_of(out)
    assert m["global_step"] == 10  # 5 steps per epoch
    assert [e["step"] for e in m["evaluations"]] == [3, 6, 9, 10]  # every 3 steps, and the last
    assert [e["epoch"] for e in m["evaluations"]] == [1, 2, 2, 2]
    losses = [e["validation"]["loss"] for e in m["evaluations"]]
    best = min(range(4), key=losses.__getitem__)
    assert m["best"]["step"] == m["evaluations"][best]["step"] and m["best"]["value"] == losses[best]
    # The train loss of an evaluation is the mean over the steps since the previous one.
    steps = [s["loss"] for s in m["steps"]]
    assert m["evaluations"][1]["train_loss"] == pytest.approx(sum(steps[3:6]) / 3, rel=1e-12)
    assert m["early_stopping"] == {
        "patience": None,
        "evaluations_without_improvement": sum(1 for e in m["evaluations"] if e["step"] > m["best"]["step"]),
        "stopped_early": False,
        "stopped_at_step": None,
    }


def _early_args(data, ckpt, out, *extra) -> list:
    # Evaluated every step on validation accuracy, which plateaus quickly on 24 examples.
    return finetune_args(
        data, ckpt, out, "--eval-steps", "1", "--early-stopping-patience", "2", "--epochs", "3", *extra
    )


def test_early_stopping_stops_after_k_evaluations_without_improvement(tmp_path, data, ckpt, capsys):
    out = tmp_path / "run"
    assert run_finetune(*_early_args(data, ckpt, out)) == 0
    m = metrics_of(out)
    accuracy = [e["validation"]["accuracy"] for e in m["evaluations"]]
    # Replay the rule on the recorded evaluations: the run ends at the first evaluation that
    # is the 2nd in a row not better than the best so far.
    best, without, stop = -1.0, 0, None
    for i, value in enumerate(accuracy):
        best, without = (value, 0) if value > best else (best, without + 1)
        if without == 2:
            stop = i + 1
            break
    assert stop is not None and stop < 15, f"the run never plateaued ({accuracy}): pick other settings"
    assert m["status"] == "completed" and m["global_step"] == stop and len(m["evaluations"]) == stop
    assert m["early_stopping"] == {
        "patience": 2,
        "evaluations_without_improvement": 2,
        "stopped_early": True,
        "stopped_at_step": stop,
    }
    assert m["best"]["value"] == max(accuracy)
    assert "early stopping: 2 evaluation(s) without improvement, stopped at step" in capsys.readouterr().out


RESUME_OPTIONS = ("--eval-steps", "2", "--early-stopping-patience", "2", "--lr-scheduler-type", "cosine")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data, ckpt) -> Path:
    full = tmp_path_factory.mktemp("full") / "run"
    assert run_finetune(*_early_args(data, ckpt, full, *RESUME_OPTIONS)) == 0
    return full


@pytest.mark.parametrize("stop_after", [2, 3, 4])  # between evaluations of every 2 steps, at one, past it
def test_resume_with_eval_steps_and_early_stopping_ends_bit_identical(tmp_path, data, ckpt, uninterrupted, stop_after):
    full, split = uninterrupted, tmp_path / "split"
    assert run_finetune(*_early_args(data, ckpt, split, *RESUME_OPTIONS), "--stop-after-steps", stop_after) == 0
    assert metrics_of(split)["status"] == "stopped"
    assert run_finetune(*_early_args(data, ckpt, split, *RESUME_OPTIONS), "--resume") == 0
    a, b = metrics_of(split), metrics_of(full)
    assert b["early_stopping"]["stopped_early"] and b["global_step"] < 15  # the case under test
    assert stop_after < b["global_step"]
    for key in ("status", "global_step", "steps", "evaluations", "best", "early_stopping"):
        assert a[key] == b[key], key
    wa, wb = load_last(split)["model"], load_last(full)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wb)
    from safetensors.torch import load_file

    sa, sb = load_file(split / "model.safetensors"), load_file(full / "model.safetensors")
    assert all(torch.equal(sa[k], sb[k]) for k in sb)


# -----------------------------------------------------------------------------------------
# Schedules, TensorBoard, fp16, plots


def test_lr_scheduler_type_gives_transformers_schedule_in_a_run(tmp_path, data, ckpt):
    import transformers

    out = tmp_path / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--lr-scheduler-type", "cosine", "--warmup-steps", "3")) == 0
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = transformers.get_scheduler("cosine", optimizer, num_warmup_steps=3, num_training_steps=10)
    expected = []
    for _ in range(10):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [s["lr"] for s in metrics_of(out)["steps"]] == expected


def test_report_to_tensorboard_writes_the_scalars(tmp_path, data, ckpt):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--report-to", "tensorboard", "--eval-steps", "4")) == 0
    m = metrics_of(out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert scalars("train/loss") == [(s["step"], pytest.approx(s["loss"], rel=1e-6)) for s in m["steps"]]
    assert [v for _, v in scalars("train/learning_rate")] == pytest.approx([s["lr"] for s in m["steps"]], rel=1e-6)
    for name in ("loss", "accuracy", "macro_f1"):
        expected = [(e["step"], pytest.approx(e["validation"][name], rel=1e-6)) for e in m["evaluations"]]
        assert scalars(f"eval/{name}") == expected
    assert [e["step"] for e in m["evaluations"]] == [4, 8, 10]


def test_report_to_tensorboard_without_tensorboard_is_refused_before_training(
    tmp_path, data, ckpt, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: importing it raises ImportError
    out = tmp_path / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--report-to", "tensorboard")) == 2
    err = capsys.readouterr().err
    assert "needs the Python package 'tensorboard'" in err and "pip install 'bert-port[tensorboard]'" in err
    assert not (out / "checkpoints" / "last-checkpoint.pt").exists()


def test_without_matplotlib_the_run_trains_and_says_the_plot_was_skipped(tmp_path, data, ckpt, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--epochs", "1")) == 0
    assert metrics_of(out)["status"] == "completed" and not (out / "training_curves.png").exists()
    assert "training_curves.png not drawn" in caplog.text and "pip install 'bert-port[plot]'" in caplog.text


def test_fp16_on_the_cpu_is_a_clear_error(tmp_path, data, ckpt, capsys):
    out = tmp_path / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--fp16")) == 2
    err = capsys.readouterr().err
    assert "--fp16 needs a CUDA device" in err and "use --bf16" in err
    assert run_finetune(*finetune_args(data, ckpt, out, "--fp16", "--bf16")) == 2
    assert "--bf16 and --fp16 exclude each other" in capsys.readouterr().err


@pytest.mark.gpu
def test_fp16_with_a_gradient_scaler_on_cuda(tmp_path, data, ckpt):
    out = tmp_path / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--device", "cuda", "--fp16", "--stop-after-steps", "4")) == 0
    assert run_finetune(*finetune_args(data, ckpt, out, "--device", "cuda", "--fp16", "--resume")) == 0
    m = metrics_of(out)
    assert m["status"] == "completed" and m["config"]["device"].startswith("cuda")
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in m["steps"])
    assert load_last(out)["scaler"]["scale"] > 0


def test_reference_hf_trains_the_transformers_twin_from_the_same_weights(tmp_path, data, minilm_path):
    """`--reference hf` runs the same loop on transformers' BertForSequenceClassification,
    built by `bert_port.reference.hf_twin` from the port model's initial weights (head
    included, drawn from the seeded RNG): the two runs' losses agree step by step."""
    config = {**TINY, "vocab_size": 30522, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    torch.manual_seed(0)
    model = BertModel(BertConfig.from_dict(config))
    model.source_dir = minilm_path
    ckpt = model.save_pretrained(tmp_path / "ckpt")
    runs = {}
    for reference in ("port", "hf"):
        extra = ["--reference", reference, "--epochs", "1", "--eval-steps", "5"]
        if reference == "hf":
            extra += ["--compare-to", tmp_path / "port"]
        assert run_finetune(*finetune_args(data, ckpt, tmp_path / reference, *extra)) == 0
        runs[reference] = metrics_of(tmp_path / reference)
    port, hf = runs["port"], runs["hf"]
    assert hf["name"].startswith("transformers BertForSequenceClassification")
    assert port["name"].startswith("bert_port BertForSequenceClassification")
    losses = {k: torch.tensor([s["loss"] for s in m["steps"]], dtype=torch.float64) for k, m in runs.items()}
    print(f"--reference hf vs port: per-step loss |diff| max {(losses['hf'] - losses['port']).abs().max():.2e}")
    torch.testing.assert_close(losses["hf"], losses["port"], atol=1e-5, rtol=1e-5)
    assert hf["comparison"]["steps_compared"] == 5 and len(hf["steps"]) == 5


# -----------------------------------------------------------------------------------------
# Settings: one dataclass for the flags, the checks and the resume rules


def test_every_setting_has_a_flag_with_help():
    parser = finetune_cli.build_parser()
    flags = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(FinetuneConfig):
        assert f.name in flags and flags[f.name].help.startswith(f.metadata["help"]), f.name
        assert flags[f.name].choices == f.metadata["choices"] or f.type == "bool", f.name
    for name in ("eval_steps", "early_stopping_patience", "lr_scheduler_type", "fp16", "problem_type", "report_to"):
        assert name in flags


def test_resume_refuses_changed_new_settings(tmp_path, data, ckpt, capsys):
    out = tmp_path / "run"
    assert run_finetune(*finetune_args(data, ckpt, out, "--stop-after-steps", "1")) == 0
    for extra, message in (
        (["--lr-scheduler-type", "cosine"], "lr_scheduler_type: checkpoint 'linear', now 'cosine'"),
        (["--eval-steps", "2"], "eval_steps: checkpoint None, now 2"),
        (["--early-stopping-patience", "3"], "early_stopping_patience: checkpoint None, now 3"),
        (["--problem-type", "multi_label_classification"], "problem_type: checkpoint 'single_label_classification'"),
    ):
        assert run_finetune(*finetune_args(data, ckpt, out, "--resume", *extra)) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"eval_steps": 0}, "--eval-steps must be a positive integer, got 0"),
        ({"early_stopping_patience": "2"}, "--early-stopping-patience must be a positive integer, got '2'"),
        ({"lr_scheduler_type": "step"}, "--lr-scheduler-type must be one of linear, cosine, constant"),
        ({"report_to": "wandb"}, "--report-to must be one of none, tensorboard, got 'wandb'"),
        ({"problem_type": "regression", "metric_for_best": "accuracy"}, "'accuracy' does not apply to regression"),
        ({"dataset": "mr", "problem_type": "regression"}, "use --problem-type single_label_classification"),
    ],
)
def test_nonsense_new_settings_are_refused(settings, message):
    from bert_port.training import FinetuneError

    with pytest.raises(FinetuneError, match="invalid fine-tuning configuration") as err:
        FinetuneConfig(**{"train": "t.csv", **settings}).validate()
    assert message in str(err.value)


def test_config_accepts_the_name_of_a_bundled_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no checkout around: only the installed package
    for name in ("finetune_mr_minilm", "finetune_sms_minilm", "finetune_mr_minilm.json"):
        settings = load_config_file(name)
        shipped = json.loads(bundled_config(name).read_text())
        assert settings == {k: v for k, v in shipped.items() if not k.startswith("_")}
        FinetuneConfig(**settings).validate()
    args = finetune_cli.build_parser().parse_args(["--config", "finetune_sms_minilm", "--lr", "3e-5"])
    cfg = finetune_cli.resolve_config(args)
    assert (cfg.dataset, cfg.lr) == ("sms", 3e-5)
    from bert_port.training import FinetuneError

    with pytest.raises(FinetuneError, match="no bundled recipe of that name .*finetune_mr_minilm"):
        load_config_file("finetune_nope")

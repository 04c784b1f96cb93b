"""The benchmark's pieces (not its timings): FLOP counting, the MR reader, argument checks,
and that neither the model nor the benchmark module imports transformers."""

from __future__ import annotations

import subprocess
import sys

import torch

from bert_port import BertConfig


def test_model_and_bench_do_not_import_transformers():
    code = "import sys, bert_port, bert_port.cli.bench; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_model_flops_counts_real_tokens(tiny_config):
    from bert_port.cli.bench import model_flops

    config = BertConfig.from_dict(tiny_config)
    H, inter, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    dense = 2 * (4 * H * H + 2 * H * inter)
    expected = L * (5 * dense + 4 * H * (9 + 4)) + 2 * 2 * H * H
    assert model_flops(config, mask) == expected
    assert model_flops(config, torch.ones(2, 4)) > expected


def test_mr_texts_are_read_as_utf8():
    from bert_port.cli.bench import read_mr_labelled, read_mr_texts

    texts = read_mr_texts()
    assert len(texts) == 10605
    assert texts[0].startswith("The Rock is destined")
    assert any("Almodóvar" in t for t in texts)
    labelled, labels = read_mr_labelled()
    assert labelled == texts and set(labels) == {0, 1}


def test_bench_refuses_unknown_section(capsys):
    from bert_port.cli.bench import main

    assert main(["--skip", "real,nope"]) == 2
    assert "unknown section(s) ['nope']" in capsys.readouterr().err


def test_config_override_restores_the_config(tiny_config):
    from bert_port import BertModel
    from bert_port.cli.bench import config_override

    model = BertModel(BertConfig.from_dict(tiny_config))
    with config_override(model, unpad_inputs=False, attn_implementation="varlen"):
        assert not model.config.unpad_inputs and model.bert_layers[0].config.attn_implementation == "varlen"
    assert model.config.unpad_inputs and model.config.attn_implementation == "sdpa"

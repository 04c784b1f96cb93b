"""`bert-port-predict`: predictions for a file of texts, from a fine-tuned output directory
(or any HF BertForSequenceClassification checkpoint), by the model's `problem_type`.

    bert-port-predict --model runs/finetune_mr_minilm --input reviews.csv --output predictions.jsonl

The output keeps every input column and adds:
  - single-label classification: `predicted_label` and the probability (softmax) of each
    label: `prob_<label>` columns in CSV/TSV, a `probabilities` object in JSONL;
  - multi-label classification: `predicted_labels`, the labels whose probability (sigmoid)
    is at least `--threshold` (joined by "|" in CSV/TSV, a list in JSONL), and each label's
    probability as above;
  - regression: `predicted_value` (one output) or `predicted_<name>` per output: the raw
    output, or its sigmoid with `--activation sigmoid` (a cross-encoder's relevance score).
    The default, `auto`, does what sentence-transformers' `CrossEncoder.predict` does: the
    activation a sentence-transformers CrossEncoder saved with the checkpoint, else raw
    (CrossEncoder itself falls back to sigmoid for any one-output model; a regression
    model's value is no logit, so this command does not).

  - token classification (NER): `entities`, each with `entity_group`, `score`, `word`, `start`,
    `end` (`--aggregation-strategy`, as transformers' token-classification pipeline; a JSON
    list in CSV/TSV cells), and `text` for a pre-split input (its words joined by spaces,
    which `start` and `end` index). A tagger also reads plain text (.txt, one text per line),
    CoNLL (.conll: the words; a tag column is ignored) and JSONL `tokens` lists.

    bert-port-predict --model runs/finetune_ner_sms_minilm --input messages.txt --output entities.jsonl

The text columns default to those the model was trained with (its `training_config.json`),
else `text` and no pair. The command reads and writes the files; the predictions are
`bert_port.training.predict` (a `Predictor`), which a notebook calls without a subprocess.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from bert_port.cli import add_threads_flag, disk_full, disk_full_line, positive_int

ACTIVATIONS = ("auto", "none", "sigmoid")  # bert_port.training.prediction.ACTIVATIONS


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bert-port-predict", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="fine-tuned output directory or classifier checkpoint")
    parser.add_argument(
        "--input",
        required=True,
        help="texts to classify: .csv, .tsv or .jsonl; a token classifier also reads .txt and .conll",
    )
    parser.add_argument("--output", required=True, help="where to write predictions: .csv, .tsv or .jsonl")
    parser.add_argument(
        "--text-column", default=None, help="column holding the text (default: the training run's, else 'text')"
    )
    parser.add_argument(
        "--text-pair-column",
        default=None,
        help="column holding the second segment (default: the training run's, if it had one)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward pass (default 64)")
    add_threads_flag(parser)
    parser.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="tokens per text or pair (default: the model's and tokenizer's limit, as transformers and "
        "CrossEncoder read; a note says how many rows were cut)",
    )
    parser.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu' or 'cuda[:N]'")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="int8: the encoder's dense layers in int8 (CPU only; bert_port.speed); default float",
    )
    parser.add_argument(
        "--threshold",
        type=_probability,
        default=0.5,
        help="multi-label models: predict the labels whose probability is at least this (default 0.5)",
    )
    parser.add_argument(
        "--activation",
        choices=ACTIVATIONS,
        default="auto",
        help="regression (score) models: 'none' writes the raw output, 'sigmoid' its sigmoid; 'auto' (default) "
        "follows the activation a CrossEncoder saved with the checkpoint, as CrossEncoder.predict does, else raw",
    )
    parser.add_argument(
        "--aggregation-strategy",
        choices=("none", "simple", "first", "average", "max"),  # bert_port.entities.AGGREGATION_STRATEGIES
        default=None,
        help="token-classification models: how word pieces become entities, as transformers' pipeline "
        "(default first: the recipe trains each word's first piece; none: one entry per word piece)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bert_port.checkpoint import CheckpointError
    from bert_port.config import ConfigError
    from bert_port.data import DataError
    from bert_port.training import FinetuneError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        job = _prepare(args)
    except (DataError, CheckpointError, ConfigError, FinetuneError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _run(job)


def _prepare(args: argparse.Namespace) -> dict:
    """Every check before any work: the device, the output path, the input, then the model
    (`Predictor.load`: its labels, activation and length). Returns what `_run` needs."""
    from bert_port.devices import resolve_device
    from bert_port.training import FinetuneError, Predictor, check_max_length
    from bert_port.training.prediction import check_quantization

    try:
        device = resolve_device(args.device, what="--device")
    except ValueError as exc:
        raise FinetuneError(str(exc)) from None
    check_quantization(args.quantization, device, args.bf16)
    out = _checked_output(args)
    inputs, pairs, records = _read_input(args, _is_tagger(args))
    options = dict(threshold=args.threshold, batch_size=args.batch_size, bf16=args.bf16, threads=args.threads)
    predictor = Predictor.load(
        args.model, device=str(device), max_length=args.max_length, quantization=args.quantization,
        activation=args.activation, aggregation_strategy=args.aggregation_strategy, **options,
    )  # fmt: skip
    if not predictor.tagger:
        clash = sorted({k for r in records for k in r} & set(predictor.problem.output_columns(predictor.names)))
        if clash:
            from bert_port.data import DataError

            raise DataError(
                f"{args.input} already has column(s) {', '.join(map(repr, clash))}, which the "
                "predictions would overwrite; rename them in the input"
            )
        check_max_length(predictor.max_length, predictor.model.config.max_sequence_length, pairs=pairs is not None)
    _output_folder(out)
    return dict(out=out, predictor=predictor, inputs=inputs, pairs=pairs, records=records)


def _is_tagger(args: argparse.Namespace) -> bool:
    """Whether --model is a token classifier (its inputs are read otherwise); --aggregation-strategy
    is refused for any other before the input is read."""
    from bert_port.checkpoint import locate_checkpoint
    from bert_port.config import BertConfig
    from bert_port.problem import ProblemType
    from bert_port.training import FinetuneError

    problem = ProblemType.of_config(BertConfig.from_json_file(locate_checkpoint(args.model).config_file))
    if problem is not ProblemType.TOKEN_CLASSIFICATION and args.aggregation_strategy is not None:
        raise FinetuneError(
            f"--aggregation-strategy applies to token-classification models, and {args.model} is a {problem} "
            "model; drop the flag"
        )
    return problem is ProblemType.TOKEN_CLASSIFICATION


def _read_input(args: argparse.Namespace, tagger: bool) -> tuple[list, list | None, list[dict]]:
    """(inputs, pairs, records): the texts (a tagger's may be lists of words), their second
    segments, and the rows the output passes through."""
    from bert_port.data import DataError, load_texts
    from bert_port.tagged import read_tagging_inputs

    if tagger:
        inputs, records = read_tagging_inputs(args.input, args.text_column or "text")
        if any("entities" in r for r in records):
            raise DataError(
                f"{args.input} already has a column 'entities', which the predictions would overwrite; rename it"
            )
        return inputs, None, records
    trained = _trained_settings(Path(args.model))
    text_column = args.text_column or trained.get("text_column") or "text"
    pair_column = args.text_pair_column or trained.get("text_pair_column")
    dataset = load_texts(args.input, text_column, None, pair_column, keep_records=True)
    return dataset.texts, dataset.pairs, dataset.records


def _checked_output(args: argparse.Namespace) -> Path:
    """--output as a path: a file of a known format, not a folder, not the --input file."""
    from bert_port.data import file_format
    from bert_port.training import FinetuneError

    file_format(args.output)
    out = Path(args.output)
    if out.is_dir():
        raise FinetuneError(f"--output {out} is a directory; give a file name ending .csv, .tsv or .jsonl")
    if out.exists() and out.resolve() == Path(args.input).resolve():
        raise FinetuneError(
            f"--output {out} is the --input file; writing it would destroy the input. Choose another --output"
        )
    return out


def _run(job: dict) -> int:
    """Predict every row and write the file; a disk or OS error while writing is exit 1."""
    predictor, records, out = job["predictor"], job["records"], job["out"]
    rows = predictor(job["inputs"], job["pairs"])
    if predictor.tagger:  # the record's own text stays; a pre-split input gets its words joined
        rows = [{k: v for k, v in row.items() if k != "text" or "text" not in r} for row, r in zip(rows, records)]
    try:
        _write_predictions(out, records, rows)
    except OSError as exc:  # the machine, not the input (a full disk); no partial file is left
        return _write_failed(exc, out)
    print(f"wrote {len(rows)} predictions to {out} ({predictor.summary(rows)})")
    return 0


def _write_failed(exc: OSError, out: Path) -> int:
    """Exit 2 with one line for a full disk (the input was fine, and --output is untouched), 1 otherwise."""
    if disk_full(exc):
        print(disk_full_line(exc, out, f"{out} was left as it was"), file=sys.stderr)
        return 2
    print(f"error: cannot write {out}: {exc}", file=sys.stderr)
    return 1


def _output_folder(out: Path) -> None:
    from bert_port.training import FinetuneError

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FinetuneError(
            f"cannot create the folder of --output {out} ({exc.strerror}); choose another --output"
        ) from None


def _write_predictions(out: Path, records: list[dict], rows: list[dict]) -> None:
    """Every input column plus the prediction (`data.write_records`: staged, never half a
    file): JSONL keeps each prediction whole, CSV/TSV flattens it into columns."""
    from bert_port.data import file_format, write_records
    from bert_port.problem import flat_prediction

    if file_format(out) == "jsonl":
        write_records([{**record, **row} for record, row in zip(records, rows)], out)
        return
    flat = [flat_prediction(row) for row in rows]
    columns = list(dict.fromkeys(k for r in records for k in r)) + list(flat[0] if flat else [])
    write_records([{**record, **row} for record, row in zip(records, flat)], out, columns)


def _trained_settings(model_dir: Path) -> dict:
    """The settings the model was fine-tuned with (its training_config.json), or {}."""
    from bert_port.training import RESOLVED_CONFIG, FinetuneError

    path = model_dir / RESOLVED_CONFIG
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"cannot read {path} ({type(exc).__name__}: {exc}); pass --max-length and --text-column explicitly"
        ) from None
    if not isinstance(settings, dict):
        raise FinetuneError(f"{path} holds {type(settings).__name__}, not the settings of a fine-tuning run")
    for key in ("text_column", "text_pair_column"):
        if settings.get(key) is not None and not isinstance(settings[key], str):
            raise FinetuneError(
                f"{path} holds {key} {settings[key]!r}, not a column name; pass --{key.replace('_', '-')}"
            )
    return settings


if __name__ == "__main__":
    sys.exit(main())

"""`bert-port-predict`: predictions for a file of texts, from a fine-tuned output directory
(or any HF BertForSequenceClassification checkpoint), by the model's `problem_type`.

    bert-port-predict --model runs/finetune_mr_minilm --input reviews.csv --output predictions.jsonl

The output keeps every input column and adds:
  - single-label classification: `predicted_label` and the probability (softmax) of each
    label: `prob_<label>` columns in CSV/TSV, a `probabilities` object in JSONL;
  - multi-label classification: `predicted_labels`, the labels whose probability (sigmoid)
    is at least `--threshold` (joined by "|" in CSV/TSV, a list in JSONL), and each label's
    probability as above;
  - regression: `predicted_value` (one output) or `predicted_<name>` per output.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from bert_port.cli import positive_int


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
    parser.add_argument("--input", required=True, help="texts to classify: .csv, .tsv or .jsonl")
    parser.add_argument("--output", required=True, help="where to write predictions: .csv, .tsv or .jsonl")
    parser.add_argument("--text-column", default="text", help="column holding the text (default 'text')")
    parser.add_argument("--text-pair-column", default=None, help="column holding the second segment, if any")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward pass (default 64)")
    parser.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="tokens per text (default: the max_length the model was trained with, else 128)",
    )
    parser.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu' or 'cuda[:N]'")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="int8: the encoder's dense layers in int8 (CPU only; bert_port.quantization); default float",
    )
    parser.add_argument(
        "--threshold",
        type=_probability,
        default=0.5,
        help="multi-label models: predict the labels whose probability is at least this (default 0.5)",
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
    return _run(args, job)


def _prepare(args: argparse.Namespace) -> dict:
    """Every check before any work: the device, the output path, the input, the model's
    label map and length; then the model and tokenizer. Returns what `_run` needs."""
    from bert_port.checkpoint import locate_checkpoint
    from bert_port.classifier import BertForSequenceClassification
    from bert_port.config import BertConfig, ConfigError
    from bert_port.data import DataError, file_format, load_texts
    from bert_port.devices import resolve_device
    from bert_port.problem import ProblemType, config_label_names
    from bert_port.tokenization import load_tokenizer
    from bert_port.training import FinetuneError, check_max_length

    try:
        device = resolve_device(args.device, what="--device")
    except ValueError as exc:
        raise FinetuneError(str(exc)) from None
    _check_quantization(args, device)
    file_format(args.output)
    out = Path(args.output)
    if out.is_dir():
        raise FinetuneError(f"--output {out} is a directory; give a file name ending .csv, .tsv or .jsonl")
    if out.exists() and out.resolve() == Path(args.input).resolve():
        raise FinetuneError(
            f"--output {out} is the --input file; writing it would destroy the input. Choose another --output"
        )
    dataset = load_texts(args.input, args.text_column, None, args.text_pair_column, keep_records=True)
    config_file = locate_checkpoint(args.model).config_file
    config = BertConfig.from_json_file(config_file)
    if not config.id2label:
        raise ConfigError(
            f"{args.model} has no id2label in its config.json: it is not a fine-tuned classifier. "
            "Pass the output directory of bert-port-finetune"
        )
    problem = ProblemType.of_config(config)
    names = config_label_names(config, str(config_file))
    clash = sorted({k for r in dataset.records for k in r} & set(problem.output_columns(names)))
    if clash:
        raise DataError(
            f"{args.input} already has column(s) {', '.join(map(repr, clash))}, which the "
            "predictions would overwrite; rename them in the input"
        )
    max_length = args.max_length if args.max_length is not None else _trained_max_length(Path(args.model))
    check_max_length(max_length, config.max_position_embeddings, pairs=args.text_pair_column is not None)
    model = BertForSequenceClassification.from_pretrained(args.model, quantization=args.quantization)
    tokenizer = load_tokenizer(model.source_dir)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FinetuneError(
            f"cannot create the folder of --output {out} ({exc.strerror}); choose another --output"
        ) from None
    return dict(
        device=device,
        out=out,
        dataset=dataset,
        problem=problem,
        names=names,
        max_length=max_length,
        model=model,
        tokenizer=tokenizer,
    )


def _check_quantization(args: argparse.Namespace, device) -> None:
    """--quantization int8 runs on the CPU in float32: refused with --bf16 or another device."""
    from bert_port.training import FinetuneError

    if args.quantization and device.type != "cpu":
        raise FinetuneError(f"--quantization {args.quantization} runs on the CPU, not on {device}: pass --device cpu")
    if args.quantization and args.bf16:
        raise FinetuneError(f"--quantization {args.quantization} runs in float32 between its int8 matmuls: drop --bf16")


def _run(args: argparse.Namespace, job: dict) -> int:
    """Predict every row and write the file; a disk or OS error while writing is exit 1."""
    from bert_port.training import predict

    model, dataset, problem, names, out = job["model"], job["dataset"], job["problem"], job["names"], job["out"]
    model.to(job["device"])
    scores = predict(model, job["tokenizer"], dataset, args.batch_size, job["max_length"], job["device"], args.bf16)
    rows = [problem.prediction(names, row, args.threshold) for row in scores.tolist()]
    try:
        _write_predictions(out, dataset.records, rows)
    except OSError as exc:  # the machine, not the input (a full disk); no partial file is left
        print(f"error: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(rows)} predictions to {out} ({problem.summary(names, rows)})")
    return 0


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


def _trained_max_length(model_dir: Path) -> int:
    """The max_length the model was fine-tuned with (its training_config.json), else 128."""
    from bert_port.training import RESOLVED_CONFIG, FinetuneError

    path = model_dir / RESOLVED_CONFIG
    if not path.is_file():
        return 128
    try:
        value = json.loads(path.read_text(encoding="utf-8"))["max_length"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FinetuneError(
            f"cannot read max_length from {path} ({type(exc).__name__}: {exc}); pass --max-length explicitly"
        ) from None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FinetuneError(f"{path} holds max_length {value!r}, not a positive integer; pass --max-length")
    return value


if __name__ == "__main__":
    sys.exit(main())

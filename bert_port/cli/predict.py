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
import csv
import json
import logging
import re
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (at least 1), got {value}")
    return value


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
    parser.add_argument("--batch-size", type=_positive_int, default=64, help="texts per forward pass (default 64)")
    parser.add_argument(
        "--max-length",
        type=_positive_int,
        default=None,
        help="tokens per text (default: the max_length the model was trained with, else 128)",
    )
    parser.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu' or 'cuda[:N]'")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument(
        "--threshold",
        type=_probability,
        default=0.5,
        help="multi-label models: predict the labels whose probability is at least this (default 0.5)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from bert_port.checkpoint import CheckpointError, locate_checkpoint
    from bert_port.classifier import BertForSequenceClassification
    from bert_port.config import BertConfig, ConfigError
    from bert_port.data import DataError, file_format, load_texts
    from bert_port.tokenization import load_tokenizer
    from bert_port.training import FinetuneError, check_max_length, predict, problem_type_of

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            raise FinetuneError(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        if device.startswith("cuda") and int(device.partition(":")[2] or 0) >= torch.cuda.device_count():
            raise FinetuneError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                "use --device cpu or an existing cuda:N"
            )
        out_format = file_format(args.output)
        out = Path(args.output)
        if out.is_dir():
            raise FinetuneError(f"--output {out} is a directory; give a file name ending .csv, .tsv or .jsonl")
        if out.exists() and out.resolve() == Path(args.input).resolve():
            raise FinetuneError(
                f"--output {out} is the --input file; writing it would destroy the input. Choose another --output"
            )
        dataset = load_texts(args.input, args.text_column, None, args.text_pair_column, keep_records=True)
        config = BertConfig.from_json_file(locate_checkpoint(args.model).config_file)
        if not config.id2label:
            raise ConfigError(
                f"{args.model} has no id2label in its config.json: it is not a fine-tuned classifier. "
                "Pass the output directory of bert-port-finetune"
            )
        problem_type = problem_type_of(config)
        names = [config.id2label[i] for i in range(config.num_labels)]
        added = list(_added_columns(problem_type, names))
        clash = sorted({k for r in dataset.records for k in r} & set(added))
        if clash:
            raise DataError(
                f"{args.input} already has column(s) {', '.join(map(repr, clash))}, which the "
                "predictions would overwrite; rename them in the input"
            )
        max_length = args.max_length if args.max_length is not None else _trained_max_length(Path(args.model))
        check_max_length(max_length, config.max_position_embeddings, pairs=args.text_pair_column is not None)
        model = BertForSequenceClassification.from_pretrained(args.model)
        tokenizer = load_tokenizer(model.source_dir)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FinetuneError(
                f"cannot create the folder of --output {out} ({exc.strerror}); choose another --output"
            ) from None
    except (DataError, CheckpointError, ConfigError, FinetuneError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model.to(device)
    scores = predict(model, tokenizer, dataset, args.batch_size, max_length, device, args.bf16)
    rows = [_prediction(problem_type, names, row, args.threshold) for row in scores.tolist()]
    try:
        _write_predictions(out, out_format, dataset.records, rows)
    except OSError as exc:  # the machine, not the input (a full disk); no partial file is left
        print(f"error: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(rows)} predictions to {out} ({_summary(problem_type, names, rows)})")
    return 0


def _added_columns(problem_type: str, names: list[str]) -> list[str]:
    """The columns the predictions add (CSV/TSV and JSONL alike, so either clash is refused)."""
    if problem_type == "regression":
        return ["predicted_value"] if len(names) == 1 else [f"predicted_{n}" for n in names]
    head = "predicted_labels" if problem_type == "multi_label_classification" else "predicted_label"
    return [head, "probabilities"] + [f"prob_{n}" for n in names]


def _prediction(problem_type: str, names: list[str], scores: list[float], threshold: float) -> dict:
    """One row's prediction as JSON: the value(s), or the label(s) and each probability."""
    if problem_type == "regression":
        return dict(zip(_added_columns(problem_type, names), scores))
    probabilities = dict(zip(names, scores))
    if problem_type == "multi_label_classification":
        return {
            "predicted_labels": [n for n, p in probabilities.items() if p >= threshold],
            "probabilities": probabilities,
        }
    return {"predicted_label": names[max(range(len(scores)), key=scores.__getitem__)], "probabilities": probabilities}


def _flat(prediction: dict) -> dict:
    """A prediction as CSV/TSV columns: `prob_<label>` columns, label lists joined by "|"."""
    flat = {k: v for k, v in prediction.items() if k != "probabilities"}
    if "predicted_labels" in flat:
        flat["predicted_labels"] = "|".join(flat["predicted_labels"])
    flat.update({f"prob_{n}": p for n, p in prediction.get("probabilities", {}).items()})
    return flat


def _summary(problem_type: str, names: list[str], rows: list[dict]) -> str:
    if problem_type == "regression":
        key = next(iter(rows[0])) if rows else "predicted_value"
        values = [r[key] for r in rows]
        return f"{key} from {min(values, default=0):.4g} to {max(values, default=0):.4g}"
    key = "predicted_labels" if problem_type == "multi_label_classification" else "predicted_label"
    counts = {n: sum(n in r[key] if isinstance(r[key], list) else n == r[key] for r in rows) for n in names}
    return ", ".join(f"{n}: {c}" for n, c in counts.items())


def _write_predictions(out: Path, out_format: str, records: list[dict], rows: list[dict]) -> None:
    """Every input column plus the prediction, written under a temporary name and renamed
    into place: never half a file."""
    from bert_port.checkpoint import atomic_write

    with atomic_write(out) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        if out_format == "jsonl":
            f.writelines(json.dumps({**record, **row}, ensure_ascii=False) + "\n" for record, row in zip(records, rows))
        else:
            flat = [_flat(row) for row in rows]
            columns = list(dict.fromkeys(k for r in records for k in r)) + list(flat[0] if flat else [])
            writer = csv.DictWriter(f, fieldnames=columns, delimiter="," if out_format == "csv" else "\t")
            writer.writeheader()
            for record, row in zip(records, flat):
                writer.writerow({**record, **row})


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

"""`bert-port-predict`: labels and class probabilities for a file of texts, from a
fine-tuned output directory (or any HF BertForSequenceClassification checkpoint).

    bert-port-predict --model runs/finetune_mr_minilm --input reviews.csv --output predictions.jsonl

The output keeps every input column and adds `predicted_label` and the probability of
each label: `prob_<label>` columns in CSV/TSV, a `probabilities` object in JSONL.
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from bert_port.checkpoint import CheckpointError, locate_checkpoint
    from bert_port.classifier import BertForSequenceClassification
    from bert_port.config import BertConfig, ConfigError
    from bert_port.data import DataError, file_format, load_texts
    from bert_port.tokenization import load_tokenizer
    from bert_port.training import FinetuneError, check_max_length, predict

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
        added = ["predicted_label", "probabilities"] + [f"prob_{n}" for n in config.id2label.values()]
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
    probs = predict(model, tokenizer, dataset, args.batch_size, max_length, device, args.bf16)
    names = [model.config.id2label[i] for i in range(probs.shape[1])]
    predicted = probs.argmax(-1).tolist()
    try:
        _write_predictions(out, out_format, dataset.records, names, predicted, probs.tolist())
    except OSError as exc:  # the machine, not the input (a full disk); no partial file is left
        print(f"error: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    counts = {n: predicted.count(i) for i, n in enumerate(names)}
    print(f"wrote {len(predicted)} predictions to {out} ({', '.join(f'{n}: {c}' for n, c in counts.items())})")
    return 0


def _write_predictions(
    out: Path, out_format: str, records: list[dict], names: list[str], predicted: list[int], probs: list[list[float]]
) -> None:
    """Every input column plus the prediction, written under a temporary name and renamed
    into place: never half a file."""
    from bert_port.checkpoint import atomic_write

    with atomic_write(out) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        if out_format == "jsonl":
            for record, p, row in zip(records, predicted, probs):
                full = {**record, "predicted_label": names[p], "probabilities": dict(zip(names, row))}
                f.write(json.dumps(full, ensure_ascii=False) + "\n")
        else:
            columns = list(dict.fromkeys(k for r in records for k in r))
            columns += ["predicted_label"] + [f"prob_{n}" for n in names]
            writer = csv.DictWriter(f, fieldnames=columns, delimiter="," if out_format == "csv" else "\t")
            writer.writeheader()
            for record, p, row in zip(records, predicted, probs):
                writer.writerow({**record, "predicted_label": names[p], **{f"prob_{n}": x for n, x in zip(names, row)}})


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

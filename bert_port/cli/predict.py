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
else `text` and no pair.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from bert_port.cli import add_threads_flag, disk_full, disk_full_line, positive_int
from bert_port.threads import governed

ACTIVATIONS = ("auto", "none", "sigmoid")
# The activations of sentence-transformers' CrossEncoder configs that this command applies.
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "none"}


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
    return _run(args, job)


def _prepare(args: argparse.Namespace) -> dict:
    """Every check before any work: the device, the output path, the input, the model's
    label map and length; then the model and tokenizer. Returns what `_run` needs."""
    from bert_port.classifier import BertForSequenceClassification
    from bert_port.data import DataError, load_texts
    from bert_port.devices import resolve_device
    from bert_port.problem import ProblemType, config_label_names
    from bert_port.tokenization import load_tokenizer
    from bert_port.training import FinetuneError, check_max_length

    try:
        device = resolve_device(args.device, what="--device")
    except ValueError as exc:
        raise FinetuneError(str(exc)) from None
    _check_quantization(args, device)
    out = _checked_output(args)
    if _tagger(args):
        return _prepare_tagging(args, device, out)
    trained = _trained_settings(Path(args.model))
    text_column = args.text_column or trained.get("text_column") or "text"
    pair_column = args.text_pair_column or trained.get("text_pair_column")
    dataset = load_texts(args.input, text_column, None, pair_column, keep_records=True)
    config, config_file = _classifier_config(args.model)
    problem = ProblemType.of_config(config)
    names = config_label_names(config, str(config_file))
    clash = sorted({k for r in dataset.records for k in r} & set(problem.output_columns(names)))
    if clash:
        raise DataError(
            f"{args.input} already has column(s) {', '.join(map(repr, clash))}, which the "
            "predictions would overwrite; rename them in the input"
        )
    if args.max_length is not None:
        check_max_length(args.max_length, config.max_position_embeddings, pairs=pair_column is not None)
    activation = _activation(args.activation, problem, _cross_encoder_activation(Path(config_file).parent, config))
    model = BertForSequenceClassification.from_pretrained(args.model, quantization=args.quantization)
    tokenizer = load_tokenizer(model.source_dir)
    # Not the training run's max_length: transformers' pipeline and CrossEncoder read up to this limit.
    limit = min(tokenizer.truncation["max_length"], config.max_position_embeddings)
    max_length = args.max_length if args.max_length is not None else limit
    check_max_length(max_length, config.max_position_embeddings, pairs=pair_column is not None)
    _output_folder(out)
    return dict(
        device=device,
        out=out,
        dataset=dataset,
        problem=problem,
        names=names,
        max_length=max_length,
        activation=activation,
        model=model,
        tokenizer=tokenizer,
    )


def _classifier_config(model_dir: str):
    """The classifier's config and its file; default labels (LABEL_i) where transformers 5 wrote
    none, as its pipeline reads them; a `ConfigError` for a model that is no classifier."""
    from bert_port.checkpoint import locate_checkpoint
    from bert_port.config import BertConfig, ConfigError

    config_file = locate_checkpoint(model_dir).config_file
    config = BertConfig.from_json_file(config_file)
    if not config.id2label and _is_sequence_classifier(config):
        config.id2label = {i: f"LABEL_{i}" for i in range(config.num_labels)}
    if not config.id2label:
        raise ConfigError(
            f"{model_dir} has no id2label in its config.json: it is not a fine-tuned classifier. "
            "Pass the output directory of bert-port-finetune"
        )
    return config, config_file


def _is_sequence_classifier(config) -> bool:
    """Whether config.json's `architectures` names a sequence classifier (saved by transformers)."""
    return any(str(a).endswith("ForSequenceClassification") for a in config.extra.get("architectures") or ())


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

    if "inputs" in job:
        return _run_tagging(args, job)
    model, dataset, problem, names, out = job["model"], job["dataset"], job["problem"], job["names"], job["out"]
    model.to(job["device"])
    with governed(model, args.threads if job["device"].type == "cpu" else None):
        scores = predict(model, job["tokenizer"], dataset, args.batch_size, job["max_length"], job["device"], args.bf16)
    if job["activation"] == "sigmoid":
        scores = scores.sigmoid()
    rows = [problem.prediction(names, row, args.threshold) for row in scores.tolist()]
    try:
        _write_predictions(out, dataset.records, rows)
    except OSError as exc:  # the machine, not the input (a full disk); no partial file is left
        return _write_failed(exc, out)
    cut = _count_truncated(job["tokenizer"], dataset, job["max_length"])
    note = f"; {cut} row(s) longer than {job['max_length']} tokens, read up to the cut" if cut else ""
    print(f"wrote {len(rows)} predictions to {out} ({problem.summary(names, rows)}{note})")
    return 0


def _count_truncated(tokenizer, dataset, max_length: int, chunk: int = 512) -> int:
    """How many texts (or pairs) of `dataset` have more than `max_length` tokens."""
    from bert_port.tokenization import encode

    cut = 0
    for start in range(0, len(dataset.texts), chunk):
        pairs = dataset.pairs[start : start + chunk] if dataset.pairs is not None else None
        batch = encode(tokenizer, dataset.texts[start : start + chunk], pairs, max_length=max_length)
        cut += sum(bool(e.overflowing) for e in batch.encodings)
    return cut


def _tagger(args: argparse.Namespace) -> bool:
    """Whether --model is a token classifier; `--aggregation-strategy` is refused for any other."""
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


def _prepare_tagging(args: argparse.Namespace, device, out: Path) -> dict:
    """A token classifier's job: its inputs (`tagged.read_tagging_inputs`), model, tokenizer, tags."""
    from bert_port.checkpoint import locate_checkpoint
    from bert_port.config import BertConfig
    from bert_port.data import DataError
    from bert_port.heads import BertForTokenClassification
    from bert_port.problem import ProblemType, config_label_names
    from bert_port.tagged import read_tagging_inputs
    from bert_port.tokenization import load_tokenizer
    from bert_port.training import check_max_length

    inputs, records = read_tagging_inputs(args.input, args.text_column or "text")
    if any("entities" in r for r in records):
        raise DataError(
            f"{args.input} already has a column 'entities', which the predictions would overwrite; rename it"
        )
    config_file = locate_checkpoint(args.model).config_file
    names = config_label_names(BertConfig.from_json_file(config_file), str(config_file))
    model = BertForTokenClassification.from_pretrained(args.model, quantization=args.quantization)
    tokenizer = load_tokenizer(model.source_dir)
    # transformers' pipeline truncates at the tokenizer's limit, not at the training length.
    limit = min(tokenizer.truncation["max_length"], model.config.max_position_embeddings)
    max_length = args.max_length if args.max_length is not None else limit
    check_max_length(max_length, model.config.max_position_embeddings)
    _output_folder(out)
    job = dict(device=device, out=out, problem=ProblemType.TOKEN_CLASSIFICATION, names=names, max_length=max_length)
    return {**job, "inputs": inputs, "records": records, "model": model, "tokenizer": tokenizer}


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


def _run_tagging(args: argparse.Namespace, job: dict) -> int:
    """Every input's entities (`bert_port.entities`), written beside its record."""
    from bert_port.entities import aggregate, decoder_of
    from bert_port.training import predict_tokens

    model, tokenizer, out = job["model"].to(job["device"]), job["tokenizer"], job["out"]
    with governed(model, args.threads if job["device"].type == "cpu" else None):
        scored = predict_tokens(
            model, tokenizer, job["inputs"], args.batch_size, job["max_length"], job["device"], args.bf16
        )
    strategy, decode = args.aggregation_strategy or "first", decoder_of(tokenizer)
    rows = [
        ({} if isinstance(x, str) or "text" in record else {"text": s.text})
        | {"entities": aggregate(s, strategy, job["names"], decode)}
        for x, record, s in zip(job["inputs"], job["records"], scored)
    ]
    try:
        _write_predictions(out, job["records"], rows)
    except OSError as exc:
        return _write_failed(exc, out)
    cut = sum(s.truncated for s in scored)
    note = f"; {cut} text(s) cut at {job['max_length']} tokens, untagged past the cut" if cut else ""
    print(f"wrote {len(rows)} predictions to {out} ({job['problem'].summary(job['names'], rows)}{note})")
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


def _cross_encoder_activation(model_dir: Path, config) -> str | None:
    """The activation a sentence-transformers CrossEncoder saved with this checkpoint, where
    its releases keep it: `config_sentence_transformers.json` (6.x), config.json's
    `sentence_transformers` (4.x, 5.x), `sbert_ce_default_activation_function` (older)."""
    from bert_port.checkpoint import ST_MODEL_CONFIG

    try:
        st_config = json.loads((model_dir / ST_MODEL_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        st_config = {}
    in_config = config.extra.get("sentence_transformers")
    for found in (
        st_config.get("activation_fn") if isinstance(st_config, dict) else None,
        in_config.get("activation_fn") if isinstance(in_config, dict) else None,
        config.extra.get("sbert_ce_default_activation_function"),
    ):
        if found is not None:
            return found
    return None


def _activation(asked: str, problem, saved: str | None) -> str:
    """'none' or 'sigmoid': what `--activation` comes to for this model (see the module doc);
    `saved` is the CrossEncoder activation the checkpoint names, if any."""
    from bert_port.problem import ProblemType
    from bert_port.training import FinetuneError

    if problem is not ProblemType.REGRESSION:
        if asked != "auto":
            raise FinetuneError(
                f"--activation {asked} is for regression (score) models, and this one is {problem}: its outputs are "
                "already probabilities. Drop --activation"
            )
        return "none"
    if asked != "auto":
        return asked
    if saved is not None and saved not in _ST_ACTIVATIONS:
        raise FinetuneError(
            f"the checkpoint's CrossEncoder activation is {saved!r}, which this command does not apply (it applies "
            "Sigmoid and Identity); pass --activation none or --activation sigmoid"
        )
    return _ST_ACTIVATIONS.get(saved, "none")


if __name__ == "__main__":
    sys.exit(main())

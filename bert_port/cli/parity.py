"""`bert-port-parity`: check, site by site, that the port computes what
`transformers.BertModel` computes on a checkpoint, per device and dtype.

Compares the embedding output, every layer's hidden state, last_hidden_state and
pooler_output on real text and on edge cases, beside transformers' own eager-vs-sdpa
spread. By default both sides read the same file, which checks the forward pass and the
key mapping but cannot see wrong weights; `--reference-checkpoint` has transformers read a
known-good checkpoint instead, to diff a converted, fine-tuned or suspect one against it.
Checkpoints whose configs differ in other fields than the shapes are compared, and the
report lists those fields as likely causes of a FAIL. The int8 row is the port loaded with
quantization="int8" against transformers in float32, within the int8 tolerance of
bert_port/tolerance.py.
Exit status: 0 when every check passes, 1 when any fails, 2 on bad usage, a checkpoint
that cannot be loaded (or two checkpoints of different shapes), or a missing extra
(transformers: `pip install 'bert-port[parity]'`; matplotlib for --plot: `bert-port[plot]`).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bert_port import parity
from bert_port.checkpoint import CheckpointError
from bert_port.cli import positive_int
from bert_port.config import BertConfig, ConfigError
from bert_port.parity.sources import (
    Source,
    config_differences,
    load_port,
    load_reference,
    quiet_transformers,
    shape_differences,
)

# Loader arguments this command has a flag for: a library error that suggests one of them
# is printed naming the flag (see CheckpointError.for_command_line).
FLAGS = {"check_finite": "--check-finite"}


def _dtypes(text: str) -> list[torch.dtype]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in parity.DTYPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown dtype(s) {', '.join(unknown) or repr(text)}; use a comma-separated list of "
            "float32, bfloat16, float16, int8"
        )
    return list(dict.fromkeys(parity.DTYPES[n] for n in names))


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bert-port-parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _checkpoint_arguments(p)
    _input_arguments(p)
    _comparison_arguments(p)
    return p


def _checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint directory, weights file (config.json beside it) or model id in the local HF "
        "cache (default: the bundled all-MiniLM-L6-v2)",
    )
    p.add_argument(
        "--reference-checkpoint",
        default=None,
        metavar="PATH",
        help="a known-good checkpoint of the same architecture for transformers to read, in any form "
        "--checkpoint accepts; the port still reads --checkpoint (default: transformers reads "
        "--checkpoint too)",
    )
    p.add_argument(
        "--check-finite",
        choices=("error", "warn", "ignore"),
        default="error",
        help="what NaN/Inf in the weights the port reads do: fail with exit 2 (default), warn and "
        "compare, or compare silently",
    )


def _input_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        default=None,
        help="directory with tokenizer.json or vocab.txt (default: the checkpoint's directory)",
    )
    p.add_argument(
        "--texts-file",
        default=None,
        help="UTF-8 file, one text per line, or two tab-separated segments for a sentence pair "
        "(default: built-in real sentences and pairs)",
    )
    p.add_argument("--batch-size", type=positive_int, default=8, help="texts per batch (default 8)")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="truncate to this many tokens; the adversarial long row has exactly this many "
        "(default: the model's max_position_embeddings, less RoBERTa's offset of pad_token_id + 1)",
    )
    p.add_argument(
        "--no-adversarial",
        action="store_true",
        help="leave out the built-in edge cases (max-length row, all-pad row, one-token rows)",
    )


def _comparison_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=("cpu", "cuda", "all"),
        default="all",
        help="where to run both models; 'all' = cpu and cuda, cuda rows skipped without a GPU (default all)",
    )
    p.add_argument(
        "--dtype",
        type=_dtypes,
        default="float32,bfloat16,float16,int8",
        help="comma-separated dtypes to check, each on every device; int8 is the port loaded with "
        "quantization='int8' (CPU only) against transformers in float32 (default float32,bfloat16,float16,int8)",
    )
    p.add_argument(
        "--attn",
        choices=("eager", "sdpa"),
        default="sdpa",
        help="attention implementation for both models; the spread uses the other one (default sdpa)",
    )
    p.add_argument(
        "--atol",
        type=_non_negative_float,
        default=None,
        help="absolute tolerance for every dtype (default: the policy in bert_port/tolerance.py, per dtype)",
    )
    p.add_argument(
        "--rtol",
        type=_non_negative_float,
        default=None,
        help="relative tolerance for every dtype (default: the policy in bert_port/tolerance.py, per dtype)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure of the report to this JSON file")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of per-layer error by device and dtype")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class Refused(Exception):
    """A run that cannot go on: printed as `error: ...`, exit status 2."""


def _message(exc: Exception) -> str:
    return exc.for_command_line(FLAGS) if isinstance(exc, CheckpointError) else str(exc)


# -- the command: parse, load, run, report ------------------------------------------------


@dataclass
class Loaded:
    """What a run compares: the two sources, the port model, and the inputs."""

    source: Source
    reference_source: Source
    ours: torch.nn.Module
    note: str | None
    batches: list
    inputs: str  # where the examples came from, for the report
    differences: list[str] = field(default_factory=list)  # config fields the two checkpoints differ in


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in (args.json, args.plot):
        if path is not None and not Path(path).resolve().parent.is_dir():
            parser.error(f"cannot write {path}: directory {Path(path).resolve().parent} does not exist")
    return args


def _require_extras(args: argparse.Namespace):
    """transformers (and matplotlib for a plot), before any work."""
    from bert_port.extras import MissingExtra, require

    try:
        transformers = require("transformers", "bert-port-parity (transformers is the reference)")
        if args.plot:
            require("matplotlib", "--plot")
    except MissingExtra as exc:
        raise Refused(str(exc)) from None
    return transformers


def load_sources(args: argparse.Namespace) -> tuple[Source, Source, torch.nn.Module, str | None, list[str]]:
    """The checkpoint, the reference checkpoint (the same one unless given), the port model,
    its note, and the config fields the two differ in. Shapes that differ are refused."""
    from bert_port.assets import minilm_dir
    from bert_port.checkpoint import locate_checkpoint

    path = args.checkpoint or str(minilm_dir())
    try:
        source = Source(path, locate_checkpoint(path), args.check_finite)
        ours, note = load_port(source, args.attn)
    except (CheckpointError, ConfigError) as exc:
        raise Refused(f"cannot load checkpoint {path}:\n{_message(exc)}") from None
    if not args.reference_checkpoint:
        return source, source, ours, note, []
    try:
        reference = Source(args.reference_checkpoint, locate_checkpoint(args.reference_checkpoint), args.check_finite)
        theirs = BertConfig.from_json_file(reference.files.config_file)
    except (CheckpointError, ConfigError) as exc:
        raise Refused(f"cannot load reference checkpoint {args.reference_checkpoint}:\n{_message(exc)}") from None
    differ = shape_differences(ours.config, theirs)
    if differ:
        raise Refused(
            f"--checkpoint {source.describe()} and --reference-checkpoint {reference.describe()} describe "
            f"different architectures, so their outputs cannot be compared: {'; '.join(differ)} (from "
            f"{source.files.config_file} and {reference.files.config_file}). Pass a reference checkpoint "
            "of the same model"
        )
    return source, reference, ours, note, config_differences(ours.config, theirs)


def load_inputs(args: argparse.Namespace, ours) -> tuple[list, str, int]:
    """The batches, where their examples came from, and the example count."""
    from bert_port import load_tokenizer

    config = ours.config
    max_length = args.max_length or config.max_sequence_length
    if not 4 <= max_length <= config.max_sequence_length:
        raise Refused(
            f"--max-length must be between 4 and the model's max_position_embeddings ({config.max_position_embeddings})"
            + (
                f" less RoBERTa's offset ({config.max_sequence_length})"
                if config.max_sequence_length < config.max_position_embeddings
                else ""
            )
            + f", got {max_length}"
        )
    tokenizer_dir = args.tokenizer or ours.source_dir
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise Refused(f"no tokenizer for this checkpoint: {exc}. Pass --tokenizer DIR") from None
    try:
        if args.texts_file:
            examples, texts_from = parity.read_texts_file(args.texts_file), f"{args.texts_file}"
        else:
            examples = [(t, None) for t in parity.DEFAULT_TEXTS] + list(parity.DEFAULT_PAIRS)
            texts_from = "built-in real sentences"
        batches = parity.build_batches(
            tokenizer, examples, batch_size=args.batch_size, max_length=max_length, adversarial=not args.no_adversarial
        )
    except ValueError as exc:
        raise Refused(str(exc)) from None
    if not config.type_vocab_size:  # DistilBERT takes no token_type_ids (transformers' forward refuses them)
        for batch in batches:
            batch.inputs.pop("token_type_ids", None)
    _check_ids_fit(batches, config, tokenizer_dir)
    return batches, texts_from, len(examples)


def _check_ids_fit(batches: list, config: BertConfig, tokenizer_dir) -> None:
    for name, limit, what in (
        ("input_ids", config.vocab_size, "vocab_size"),
        ("token_type_ids", config.type_vocab_size, "type_vocab_size"),
    ):
        if any(name not in b.inputs for b in batches):
            continue
        top = max(int(b.inputs[name].max()) for b in batches)
        if top >= limit:
            raise Refused(
                f"the tokenizer in {tokenizer_dir} produces {name} {top}, outside the model's "
                f"{what}={limit}: pass --tokenizer with the checkpoint's own tokenizer"
            )


def load(args: argparse.Namespace) -> Loaded:
    source, reference, ours, note, differences = load_sources(args)
    batches, texts_from, count = load_inputs(args, ours)
    pairs = sum(b.rows for b in batches if b.name.startswith("pairs"))
    max_length = args.max_length or ours.config.max_sequence_length
    inputs = (
        f"{count} examples from {texts_from} ({pairs} pairs), max length {max_length}"
        + ("" if args.no_adversarial else ", plus the edge cases")
        + f"; {len(batches)} batches, {sum(b.rows for b in batches)} rows, "
        f"{sum(b.real_tokens for b in batches)} real and {sum(b.pad_tokens for b in batches)} pad tokens"
    )
    return Loaded(source, reference, ours, note, batches, inputs, differences)


def load_references(transformers, args: argparse.Namespace, loaded: Loaded):
    """transformers' model (the reference), how it got its weights, and its copy under the
    other attention implementation (the spread)."""
    with quiet_transformers(transformers):
        try:
            reference, how = load_reference(
                transformers,
                loaded.ours,
                loaded.reference_source,
                args.attn,
                same_as_ours=loaded.reference_source is loaded.source,
            )
        except (CheckpointError, ConfigError) as exc:
            raise Refused(
                f"cannot load reference checkpoint {loaded.reference_source.name}:\n{_message(exc)}"
            ) from None
        spread_reference = copy.deepcopy(reference)
        spread_reference.set_attn_implementation(_other(args.attn))
    return reference, how, spread_reference


def _other(attn: str) -> str:
    return "eager" if attn == "sdpa" else "sdpa"


def _meta(transformers, args: argparse.Namespace, loaded: Loaded, how: str) -> dict[str, str]:
    """The report's header: what each side read, the model, the reference, the inputs."""
    source, reference, config = loaded.source, loaded.reference_source, loaded.ours.config
    if reference is source:
        meta = {"checkpoint": f"{source.describe()}, read by both the port and transformers"}
    else:
        meta = {
            "checkpoint": f"{source.describe()}, read by the port",
            "reference_checkpoint": f"{reference.describe()}, read by transformers (reference and spread)",
            "compares": "the two checkpoints' weights, through the port's loader and forward pass against "
            "transformers': a FAIL means they differ beyond tolerance (without "
            "--reference-checkpoint, the port alone is checked)",
        }
    if loaded.differences:
        meta["config_differences"] = f"{'; '.join(loaded.differences)} (--checkpoint vs --reference-checkpoint)"
    meta["model"] = (
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads, vocab {config.vocab_size}"
    )
    meta["reference"] = f"transformers {transformers.__version__}: {how}"
    meta["attention"] = (
        f"{args.attn} on both sides; spread = transformers {_other(args.attn)} vs transformers {args.attn}"
    )
    meta["inputs"] = loaded.inputs
    meta["versions"] = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if loaded.note:
        meta["note"] = loaded.note
    return meta


def _tolerances(args: argparse.Namespace) -> dict:
    return {
        dtype: parity.Tolerance(
            atol=tol.atol if args.atol is None else args.atol, rtol=tol.rtol if args.rtol is None else args.rtol
        )
        for dtype, tol in parity.TOLERANCES.items()
    }


def run(transformers, args: argparse.Namespace, loaded: Loaded) -> parity.Report:
    """Both models on every device x dtype asked for, site by site."""
    reference, how, spread_reference = load_references(transformers, args, loaded)
    rows = parity.check_matrix(
        loaded.ours,
        reference,
        loaded.batches,
        devices=["cpu", "cuda"] if args.device == "all" else [args.device],
        dtypes=args.dtype,
        tolerances=_tolerances(args),
        spread_reference=spread_reference,
        progress=not args.no_progress,
    )
    return parity.Report(rows, _meta(transformers, args, loaded, how))


def report(args: argparse.Namespace, result: parity.Report, batches: list) -> int:
    """Print the report, write the JSON and the plot asked for; the exit status."""
    print(parity.format_report(result))
    if args.json:
        data = parity.report_to_json(result)
        data["batches"] = [
            {"name": b.name, "rows": b.rows, "real_tokens": b.real_tokens, "pad_tokens": b.pad_tokens} for b in batches
        ]
        tolerances = _tolerances(args)
        data["tolerances"] = {parity.dtype_name(d): {"atol": t.atol, "rtol": t.rtol} for d, t in tolerances.items()}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        parity.plot_report(result, args.plot)
        print(f"wrote {args.plot}")
    if not result.ran:
        print(f"error: nothing was compared: {result.rows[0].skipped}. Use --device cpu", file=sys.stderr)
        return 2
    return 0 if result.passed else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        transformers = _require_extras(args)
        loaded = load(args)
        result = run(transformers, args, loaded)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return report(args, result, loaded.batches)


if __name__ == "__main__":
    sys.exit(main())

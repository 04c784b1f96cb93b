"""`bert-port-parity`: check, site by site, that the port computes what
`transformers.BertModel` computes on a checkpoint, per device and dtype.

Compares the embedding output, every layer's hidden state, last_hidden_state and
pooler_output on real text and on edge cases, beside transformers' own eager-vs-sdpa
spread. By default both sides read the same file, which checks the forward pass and the
key mapping but cannot see wrong weights; `--reference-checkpoint` has transformers read a
known-good checkpoint instead, to diff a converted, fine-tuned or suspect one against it.
Exit status: 0 when every check passes, 1 when any fails, 2 on bad usage, a checkpoint
that cannot be loaded (or two checkpoints of different architectures), or a missing extra
(transformers: `pip install 'bert-port[parity]'`; matplotlib for --plot: `bert-port[plot]`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bert_port import parity
from bert_port.checkpoint import CheckpointError, CheckpointFiles

# Loader arguments this command has a flag for: a library error that suggests one of them
# is printed naming the flag (see CheckpointError.for_command_line).
FLAGS = {"check_finite": "--check-finite"}
# Config fields that decide the tensors' shapes or the forward pass: two checkpoints compared
# with --reference-checkpoint must agree on every one of them.
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "max_position_embeddings",
    "type_vocab_size",
    "layer_norm_eps",
    "position_embedding_type",
    "is_decoder",
)


def _dtypes(text: str) -> list[torch.dtype]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in parity.DTYPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown dtype(s) {', '.join(unknown) or repr(text)}; use a comma-separated list of "
            "float32, bfloat16, float16"
        )
    return list(dict.fromkeys(parity.DTYPES[n] for n in names))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bert-port-parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    p.add_argument("--batch-size", type=_positive_int, default=8, help="texts per batch (default 8)")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="truncate to this many tokens; the adversarial long row has exactly this many "
        "(default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--no-adversarial",
        action="store_true",
        help="leave out the built-in edge cases (max-length row, all-pad row, one-token rows)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda", "all"),
        default="all",
        help="where to run both models; 'all' = cpu and cuda, cuda rows skipped without a GPU (default all)",
    )
    p.add_argument(
        "--dtype",
        type=_dtypes,
        default="float32,bfloat16,float16",
        help="comma-separated dtypes to check, each on every device (default float32,bfloat16,float16)",
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
    return p


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _message(exc: Exception) -> str:
    return exc.for_command_line(FLAGS) if isinstance(exc, CheckpointError) else str(exc)


@dataclass
class Source:
    """A checkpoint as the command line names it (path or model id), resolved to files."""

    name: str
    files: CheckpointFiles
    check_finite: str = "error"

    def describe(self) -> str:
        files, path = self.files, Path(self.name)
        if path.is_dir():
            return f"{self.name} ({files.weights_file.relative_to(files.directory)})"
        return str(files.weights_file) if path.exists() else f"{self.name} ({files.weights_file})"


def architecture_differences(ours, theirs) -> list[str]:
    """`field: a vs b` for each ARCHITECTURE_FIELDS entry on which two BertConfigs differ."""
    return [
        f"{name} {getattr(ours, name)!r} vs {getattr(theirs, name)!r}"
        for name in ARCHITECTURE_FIELDS
        if getattr(ours, name) != getattr(theirs, name)
    ]


@contextlib.contextmanager
def _quiet(transformers):
    """transformers' load report and weight-loading bar would bury the parity report."""
    utils = transformers.utils.logging
    verbosity, bar = utils.get_verbosity(), utils.is_progress_bar_enabled()
    utils.set_verbosity_error()
    utils.disable_progress_bar()
    try:
        yield
    finally:
        utils.set_verbosity(verbosity)
        if bar:
            utils.enable_progress_bar()


def load_port(source: Source, attn: str):
    """Our model in float32 on the CPU, and a note when it was loaded without its pooler."""
    from bert_port import BertModel

    files = source.files
    kwargs = dict(
        config_file=files.config_file, dtype=torch.float32, attn_implementation=attn, check_finite=source.check_finite
    )
    model = BertModel.from_pretrained(files.weights_file, **kwargs)
    pooler = [k for k in model.loading_info["newly_initialized"] if k.startswith("pooler_dense.")]
    if not pooler:
        return model, None
    # e.g. a checkpoint saved from BertForMaskedLM, which has no pooler: a random one is no comparison
    model = BertModel.from_pretrained(files.weights_file, add_pooling_layer=False, **kwargs)
    return model, f"the checkpoint has no {' or '.join(pooler)}, so pooler_output is not compared"


def _hf_view(files, stack: contextlib.ExitStack) -> Path | None:
    """A directory from which transformers reads exactly the weights file we read: the
    checkpoint directory itself, or for another file name a temporary directory of links."""
    from bert_port.checkpoint import PT_WEIGHTS, SAFE_WEIGHTS, WEIGHT_NAMES

    preferred = next((files.directory / n for n in WEIGHT_NAMES if (files.directory / n).is_file()), None)
    if (
        preferred is not None
        and preferred.resolve() == files.weights_file.resolve()
        and files.config_file == (files.directory / "config.json")
    ):
        return files.directory
    name = {".safetensors": SAFE_WEIGHTS, ".bin": PT_WEIGHTS, ".pt": PT_WEIGHTS, ".pth": PT_WEIGHTS}.get(
        files.weights_file.suffix
    )
    if name is None:
        return None
    view = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bert-port-parity-")))
    (view / "config.json").symlink_to(files.config_file.resolve())
    (view / name).symlink_to(files.weights_file.resolve())
    return view


def load_reference(
    transformers, ours, source: Source, attn: str, same_as_ours: bool = True
) -> tuple[torch.nn.Module, str]:
    """transformers.BertModel holding the weights of `source` (the checkpoint `ours` was
    loaded from, or with `same_as_ours=False` a reference checkpoint), and how it got them.

    Preferably transformers reads the checkpoint file itself, so that our key mapping is
    checked too. When it cannot (a layout it does not know, such as DDP `module.` keys), it
    is built from our config and given the weights as the port's loader reads them, strictly."""
    files = source.files
    kwargs = dict(dtype=torch.float32, attn_implementation=attn, add_pooling_layer=ours.add_pooling_layer)
    why = "transformers cannot read this file layout"
    with contextlib.ExitStack() as stack:
        try:
            view = _hf_view(files, stack)
            if view is not None:
                ref, info = transformers.BertModel.from_pretrained(
                    str(view), local_files_only=True, output_loading_info=True, **kwargs
                )
                bad = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
                if not bad:
                    return ref.eval(), f"transformers.BertModel.from_pretrained read {files.weights_file} itself"
                why = f"transformers' own loader leaves {len(bad)} tensor(s) unloaded ({', '.join(bad[:4])})"
        except Exception as exc:  # noqa: BLE001  any failure of transformers' loader: fall back, and say so in the report
            why = f"transformers cannot read it ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if same_as_ours:
        donor, whose = ours, "the port's weights"
    else:
        donor, _ = load_port(source, attn)
        whose = f"the weights of {files.weights_file} as the port's loader reads them"
        if ours.add_pooling_layer and not donor.add_pooling_layer:
            raise CheckpointError(
                f"the reference checkpoint {files.weights_file} has no pooler (pooler.dense.*) and --checkpoint has "
                "one. Swap the two: with the pooler-less one as --checkpoint, pooler_output is left out of the "
                "comparison"
            )
    hf_config = transformers.BertConfig(**ours.config.to_dict())
    hf_config._attn_implementation = attn
    ref = transformers.BertModel(hf_config, add_pooling_layer=ours.add_pooling_layer)
    ref.load_state_dict(donor.hf_state_dict(), strict=True)
    return ref.eval(), (
        f"transformers.BertModel(config) given {whose} via hf_state_dict() (strict), because {why}; "
        "this checks the forward pass but not the key mapping"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in (args.json, args.plot):
        if path is not None and not Path(path).resolve().parent.is_dir():
            parser.error(f"cannot write {path}: directory {Path(path).resolve().parent} does not exist")

    from bert_port.extras import MissingExtra, require

    try:  # before any work: the reference, and matplotlib when a plot is asked for
        transformers = require("transformers", "bert-port-parity (transformers is the reference)")
        if args.plot:
            require("matplotlib", "--plot")
    except MissingExtra as exc:
        return _fail(str(exc))

    from bert_port import BertConfig, ConfigError, load_tokenizer
    from bert_port.assets import minilm_dir
    from bert_port.checkpoint import locate_checkpoint

    path = args.checkpoint or str(minilm_dir())
    try:
        source = Source(path, locate_checkpoint(path), args.check_finite)
        ours, note = load_port(source, args.attn)
    except (CheckpointError, ConfigError) as exc:
        return _fail(f"cannot load checkpoint {path}:\n{_message(exc)}")
    config = ours.config
    reference_source = source
    if args.reference_checkpoint:
        try:
            reference_source = Source(
                args.reference_checkpoint, locate_checkpoint(args.reference_checkpoint), args.check_finite
            )
            differ = architecture_differences(config, BertConfig.from_json_file(reference_source.files.config_file))
        except (CheckpointError, ConfigError) as exc:
            return _fail(f"cannot load reference checkpoint {args.reference_checkpoint}:\n{_message(exc)}")
        if differ:
            return _fail(
                f"--checkpoint {source.describe()} and --reference-checkpoint {reference_source.describe()} describe "
                f"different architectures, so their outputs cannot be compared: {'; '.join(differ)} (from "
                f"{source.files.config_file} and {reference_source.files.config_file}). Pass a reference checkpoint "
                "of the same model"
            )

    max_length = args.max_length or config.max_position_embeddings
    if not 4 <= max_length <= config.max_position_embeddings:
        return _fail(
            f"--max-length must be between 4 and the model's max_position_embeddings "
            f"({config.max_position_embeddings}), got {max_length}"
        )
    tokenizer_dir = args.tokenizer or ours.source_dir
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (FileNotFoundError, OSError, ValueError) as exc:
        return _fail(f"no tokenizer for this checkpoint: {exc}. Pass --tokenizer DIR")
    try:
        if args.texts_file:
            examples = parity.read_texts_file(args.texts_file)
            texts_from = f"{args.texts_file}"
        else:
            examples = [(t, None) for t in parity.DEFAULT_TEXTS] + list(parity.DEFAULT_PAIRS)
            texts_from = "built-in real sentences"
        batches = parity.build_batches(
            tokenizer, examples, batch_size=args.batch_size, max_length=max_length, adversarial=not args.no_adversarial
        )
    except ValueError as exc:
        return _fail(str(exc))
    for name, limit, what in (
        ("input_ids", config.vocab_size, "vocab_size"),
        ("token_type_ids", config.type_vocab_size, "type_vocab_size"),
    ):
        top = max(int(b.inputs[name].max()) for b in batches)
        if top >= limit:
            return _fail(
                f"the tokenizer in {tokenizer_dir} produces {name} {top}, outside the model's "
                f"{what}={limit}: pass --tokenizer with the checkpoint's own tokenizer"
            )

    with _quiet(transformers):
        try:
            reference, how = load_reference(
                transformers, ours, reference_source, args.attn, same_as_ours=reference_source is source
            )
        except (CheckpointError, ConfigError) as exc:
            return _fail(f"cannot load reference checkpoint {reference_source.name}:\n{_message(exc)}")
        other = "eager" if args.attn == "sdpa" else "sdpa"
        spread_reference = copy.deepcopy(reference)
        spread_reference.set_attn_implementation(other)

    tolerances = {
        dtype: parity.Tolerance(
            atol=tol.atol if args.atol is None else args.atol, rtol=tol.rtol if args.rtol is None else args.rtol
        )
        for dtype, tol in parity.TOLERANCES.items()
    }
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    pairs = sum(b.rows for b in batches if b.name.startswith("pairs"))
    if reference_source is source:
        sides = {"checkpoint": f"{source.describe()}, read by both the port and transformers"}
    else:
        sides = {
            "checkpoint": f"{source.describe()}, read by the port",
            "reference_checkpoint": f"{reference_source.describe()}, read by transformers (reference and spread)",
            "compares": "the two checkpoints' weights, through the port's loader and forward pass against "
            "transformers': a FAIL means they differ beyond tolerance (without "
            "--reference-checkpoint, the port alone is checked)",
        }
    meta = {
        **sides,
        "model": (
            f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads, vocab {config.vocab_size}"
        ),
        "reference": f"transformers {transformers.__version__}: {how}",
        "attention": f"{args.attn} on both sides; spread = transformers {other} vs transformers {args.attn}",
        "inputs": (
            f"{len(examples)} examples from {texts_from} ({pairs} pairs), max length {max_length}"
            + ("" if args.no_adversarial else ", plus the edge cases")
            + f"; {len(batches)} batches, {sum(b.rows for b in batches)} rows, "
            f"{sum(b.real_tokens for b in batches)} real and {sum(b.pad_tokens for b in batches)} pad tokens"
        ),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
    }
    if note:
        meta["note"] = note

    rows = parity.check_matrix(
        ours,
        reference,
        batches,
        devices=devices,
        dtypes=args.dtype,
        tolerances=tolerances,
        spread_reference=spread_reference,
        progress=not args.no_progress,
    )
    report = parity.Report(rows, meta)
    print(parity.format_report(report))

    if args.json:
        data = parity.report_to_json(report)
        data["batches"] = [
            {"name": b.name, "rows": b.rows, "real_tokens": b.real_tokens, "pad_tokens": b.pad_tokens} for b in batches
        ]
        data["tolerances"] = {parity.dtype_name(d): {"atol": t.atol, "rtol": t.rtol} for d, t in tolerances.items()}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        parity.plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    if not report.ran:
        return _fail(f"nothing was compared: {rows[0].skipped}. Use --device cpu")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

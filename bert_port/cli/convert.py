"""`bert-port-convert SRC DST`: rewrite a BERT checkpoint in the clean Hugging Face layout.
`bert-port-convert --repair DIR`: finish, or drop, what a killed save left in DIR.

SRC is a checkpoint directory, a weights file (`pytorch_model.bin`, `*.safetensors`, a
shard index) with `config.json` beside it, or a model id in the local HF cache. Any layout
the loader reads (legacy `LayerNorm.gamma/beta`, `bert.`/`module.`/`_orig_mod.` prefixes,
pretraining heads, sentence-transformers) becomes HF names in `model.safetensors` (sharded
above `--max-shard-size`), with `config.json`, the tokenizer files and a sentence-transformers
folder's own files (`modules.json`, `1_Pooling/`, ...), in DST. A task head (sequence or
token classification, question answering) is kept, and so are the pretraining heads (`cls.*`)
with `--keep-heads`; otherwise DST is a `BertModel`. The report says what was renamed, what
was dropped, and that DST reads back bit for bit.

`bert-port-convert SRC DST --to onnx` writes DST/model.onnx instead (with SRC's config.json
and tokenizer files beside it): the model SRC is (bare, a task head, or the MLM/pretraining
head its config.json's `architectures` names, or `--keep-heads` keeps), float32, dynamic batch
and sequence, checked in ONNX Runtime against the model at export (`bert_port.onnx_export`).
Needs `pip install 'bert-port[onnx]'`.

A save killed after its commit point leaves a folder that loads refuse (they never write);
`--repair` finishes that save, or drops its journal when another tool has written the folder
since, and deletes the temporaries killed saves recorded, nothing else.

Exit status: 0 converted and verified (or repaired); 1 the written files did not read back identically
(ONNX: ONNX Runtime's outputs are not the model's; no model.onnx is left);
2 bad input (unreadable or mismatched checkpoint, bad config, DST already holds a checkpoint)
or DST cannot be written (permissions, disk full; its previous files are left intact).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bert_port.cli import disk_full, disk_full_line

if TYPE_CHECKING:
    from bert_port import checkpoint as ckpt
    from bert_port.base_bert import BertPreTrainedModel
    from bert_port.config import BertConfig

DTYPES = {"keep": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Loader arguments this command has a flag for: a library error that suggests one of them
# is printed naming the flag (see CheckpointError.for_command_line).
FLAGS = {"check_finite": "--check-finite", "config_file": "--config-file", "revision": "--revision"}
ONNX_NAME = "model.onnx"
LM_ARCHITECTURES = {"BertForMaskedLM", "BertForPreTraining"}  # heads --to onnx keeps when config.json names them


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bert-port-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", nargs="?", help="checkpoint directory, weights file, or model id in the local HF cache")
    parser.add_argument("dst", nargs="?", help="output directory (created if needed)")
    parser.add_argument(
        "--repair", metavar="DIR", default=None, help="finish or drop a killed save in DIR, instead of converting"
    )
    parser.add_argument(
        "--to",
        choices=["hf", "onnx"],
        default="hf",
        help="hf: Hugging Face safetensors (default); onnx: DST/model.onnx",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="shard the safetensors above this size (default 5GB)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="keep", help="cast floating weights (default keep)")
    parser.add_argument(
        "--check-finite",
        choices=["error", "warn", "ignore"],
        default="error",
        help="what NaN/Inf weights do: fail (default), warn, or pass silently",
    )
    parser.add_argument("--config-file", default=None, help="config.json to use when SRC is a bare weights file")
    parser.add_argument("--revision", default="main", help="cache ref or commit when SRC is a model id")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    parser.add_argument(
        "--keep-heads",
        action="store_true",
        help="keep the pretraining heads (cls.*): DST is then a BertForPreTraining or BertForMaskedLM checkpoint",
    )
    return parser


def _holds_checkpoint(directory: Path) -> list[str]:
    from bert_port import checkpoint as ckpt

    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name in ckpt.WEIGHT_NAMES or p.suffix == ".safetensors")


def _model_class(state: dict[str, torch.Tensor], config: BertConfig, keep_heads: bool) -> tuple[type, dict]:
    """The model that keeps what SRC is: its task head always (question answering, token or
    sequence classification), its pretraining heads with `keep_heads` (BertForPreTraining,
    or BertForMaskedLM with the MLM head only), else BertModel with or without a pooler.
    `architectures` in config.json tells the two classifications apart, or, without it, the
    pooler: transformers' token classifier has none, its sequence classifier always one."""
    from bert_port import BertModel, heads
    from bert_port import checkpoint as ckpt
    from bert_port.classifier import BertForSequenceClassification

    keys = [ckpt.normalize_hf_key(k) for k in state]

    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in keys)

    architectures = config.extra.get("architectures") or []
    if "BertForMultipleChoice" in architectures:
        raise ValueError("SRC is a BertForMultipleChoice checkpoint, whose head the port does not have")
    if has("qa_outputs."):
        return heads.BertForQuestionAnswering, {}
    if has("classifier."):
        token = "BertForTokenClassification" in architectures or (not architectures and not has("pooler."))
        return (heads.BertForTokenClassification if token else BertForSequenceClassification), {}
    if keep_heads and has("cls.predictions."):
        return (heads.BertForPreTraining if has("cls.seq_relationship.") else heads.BertForMaskedLM), {}
    return BertModel, {"add_pooling_layer": has("pooler.")}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bytes, not values: torch.equal is False for NaN == NaN, so a checkpoint converted with
    # --check-finite warn would never verify (and it calls -0.0 equal to 0.0).
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def _refusal(dst: Path, source_dir: Path, overwrite: bool) -> str | None:
    """Why DST may not be written, or None."""
    blocker = next((p for p in (dst, *dst.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"DST {dst} cannot be a folder: {blocker} is a file. Give the path of a folder (created if missing)"
    if dst.exists() and dst.resolve() == source_dir.resolve():
        return f"DST {dst} is the source directory; write to a new directory"
    existing = _holds_checkpoint(dst)
    if existing and not overwrite:
        return f"{dst} already holds a checkpoint ({', '.join(existing)}); pass --overwrite to replace it"
    return None


def _load(args: argparse.Namespace, folder: Path) -> tuple[BertPreTrainedModel, ckpt.CheckpointFiles]:
    """SRC as the port model that keeps what it is, loaded as `from_pretrained` loads, and its files."""
    from bert_port import BertConfig, loading
    from bert_port import checkpoint as ckpt

    with ckpt.read_snapshot(folder):  # config and weights of one save
        files = ckpt.locate_checkpoint(args.src, args.config_file, args.revision)
        config = BertConfig.from_json_file(files.config_file)
        weights = loading.read_checkpoint(files, config)
    lm = args.to == "onnx" and bool(LM_ARCHITECTURES & set(config.extra.get("architectures") or []))
    cls, init_kwargs = _model_class(weights.tensors, config, args.keep_heads or lm)
    model = loading.build_and_load(
        cls, config, weights, files, init_kwargs=init_kwargs, dtype=DTYPES[args.dtype], check_finite=args.check_finite
    )
    return model, files


def _report(model: BertPreTrainedModel, files, dst: Path, saved: dict, keep_heads: bool) -> None:
    from bert_port import checkpoint as ckpt
    from bert_port import saving

    info, config = model.loading_info, model.config
    renamed = info["renamed"]
    legacy = [k for k in renamed if k.endswith(("LayerNorm.gamma", "LayerNorm.beta"))]
    prefixed = [k for k in renamed if k.startswith(ckpt.WRAPPER_PREFIXES)]
    nbytes = sum(t.numel() * t.element_size() for t in saved.values())
    out_files = sorted(p.name for p in dst.iterdir() if not p.name.startswith("."))
    print(f"source:    {files.weights_file}")
    print(f"config:    {files.config_file}")
    print(
        f"model:     {type(model).__name__} ({config.num_hidden_layers} layers, hidden {config.hidden_size})"
        + ("" if getattr(model, "add_pooling_layer", True) else ", no pooler in the checkpoint")
    )
    print(
        f"renamed:   {len(renamed)} keys ({len(legacy)} legacy LayerNorm gamma/beta -> weight/bias, "
        f"{len(prefixed)} with a wrapper prefix stripped)"
    )
    dropped, buffers = info["dropped"], info["buffers"]
    # The flag keeps an MLM head (with or without NSP), not an NSP head alone.
    keepable = not keep_heads and any(ckpt.normalize_hf_key(k).startswith("cls.predictions.") for k in dropped)
    print(
        f"dropped:   {len(dropped)} pretraining-head tensors"
        + (f": {_names(dropped)}" if dropped else "")
        + (" (--keep-heads keeps them)" if keepable else "")
    )
    print(f"skipped:   {len(buffers)} buffers" + (f": {_names(buffers)}" if buffers else ""))
    if info["unused"]:
        print(f"unused:    {_names(info['unused'])}")
    if info["newly_initialized"]:
        print(f"new:       {_names(info['newly_initialized'])} (initialised afresh: not in the source)")
    print(f"written:   {dst}: {', '.join(out_files)}")
    st_files, st_folders = saving.sentence_transformers_files(model)
    if st_files:  # a sentence-transformers folder stays one: SentenceTransformer(DST) pools as SRC did
        print(f"copied:    sentence-transformers files from SRC: {', '.join(st_files + [f + '/' for f in st_folders])}")
    print(f"tensors:   {len(saved)}, {ckpt.human_bytes(nbytes)}, {str(model.dtype).removeprefix('torch.')}")


def convert(args: argparse.Namespace) -> int:
    """Load SRC and save it to DST with the library's own loading and saving functions, then
    read DST back and compare it bit for bit with what was saved."""
    from bert_port import checkpoint as ckpt
    from bert_port import saving

    dst = Path(args.dst).expanduser()
    folder = ckpt.checkpoint_folder(args.src, args.revision)
    refusal = _refusal(dst, folder, args.overwrite)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if args.to == "onnx":
        return to_onnx(args, dst, folder)
    ckpt.parse_size(args.max_shard_size)  # a bad size fails before any work

    model, files = _load(args, folder)
    saving.save_pretrained(model, dst, max_shard_size=args.max_shard_size)
    saved = saving.hf_state_dict(model)
    written = ckpt.locate_checkpoint(dst)
    reread = ckpt.read_weights(written.weights_file).tensors
    same = reread.keys() == saved.keys() and all(_same_bits(reread[k], saved[k].cpu()) for k in saved)
    _report(model, files, dst, saved, args.keep_heads)
    if not same:
        print(f"FAILED: {written.weights_file} does not read back identically to what was saved", file=sys.stderr)
        return 1
    print(f"verified:  {written.weights_file.name} reads back bit for bit ({len(saved)} tensors)")
    return 0


def to_onnx(args: argparse.Namespace, dst: Path, folder: Path) -> int:
    """SRC's model, as `from_pretrained` gives it (float32, the speed layer on), exported to
    DST/model.onnx by `onnx_export.export_onnx` and checked there, with SRC's config and
    tokenizer files beside it: one staged write of DST, as a save is (random temporaries, one
    commit, DST locked throughout, so exports into one folder take turns and each checks and
    reports its own file)."""
    from bert_port import checkpoint as ckpt
    from bert_port import speed
    from bert_port.onnx_export import ExportError, export_onnx
    from bert_port.tokenization import load_tokenizer

    if args.dtype not in ("keep", "float32"):
        print(f"error: --to onnx exports float32; drop --dtype {args.dtype}", file=sys.stderr)
        return 2
    args.dtype = "float32"
    model, files = _load(args, folder)
    copies = [
        files.config_file,
        *(files.directory / n for n in ckpt.TOKENIZER_FILES if (files.directory / n).is_file()),
    ]
    speed.optimize(model)
    tokenizer = load_tokenizer(files.directory)
    try:
        with ckpt.StagedWrite(dst) as stage:
            clashes = [n for n in [ONNX_NAME, *(c.name for c in copies)] if (dst / n).exists()]
            if clashes and not args.overwrite:  # under the lock: an export that finished meanwhile counts
                raise ValueError(f"{dst} already holds {', '.join(clashes)}; pass --overwrite to replace them")
            result = export_onnx(model, dst / ONNX_NAME, tokenizer, stage=stage)
            for copy in copies:
                stage.copy(copy.name, copy)
    except ExportError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"source:    {files.weights_file}")
    print(f"model:     {type(model).__name__} ({model.config.num_hidden_layers} layers), float32")
    print(f"written:   {dst}: {ONNX_NAME} ({ckpt.human_bytes(result.size)}, sha256 {result.sha256}), "
          f"{', '.join(c.name for c in copies)}")  # fmt: skip
    print(f"inputs:    input_ids, attention_mask, token_type_ids (batch and sequence dynamic, up to "
          f"{model.config.max_position_embeddings} tokens)")  # fmt: skip
    diffs = ", ".join(f"{name} {value:.2g}" for name, value in result.worst.items())
    print(f"verified:  ONNX Runtime against the model on a new batch, max |diff|: {diffs} ({result.tolerance})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    repairing, converting = args.repair is not None, args.src is not None and args.dst is not None
    if repairing == converting or (repairing and args.src is not None):
        parser.error("give SRC and DST to convert, or --repair DIR alone")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")

    from bert_port import CheckpointError, ConfigError
    from bert_port import checkpoint as ckpt
    from bert_port.extras import MissingExtra

    try:
        if args.repair is not None:
            print(ckpt.repair(args.repair))
            return 0
        return convert(args)
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError, ValueError) as exc:
        print(f"error: {exc.for_command_line(FLAGS) if isinstance(exc, CheckpointError) else exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # DST not writable, disk full, ...: the previous files in DST are intact
        kept = f"the files that were in {args.dst or args.repair} are intact"
        print(disk_full_line(exc, args.dst, kept) if disk_full(exc) else f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

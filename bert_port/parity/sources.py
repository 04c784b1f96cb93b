"""The checkpoints a parity run reads, and transformers' model of the reference.

`load_port` reads a checkpoint into the port; `load_reference` gives transformers' model of
a checkpoint, read by transformers itself where it can (so the key mapping is checked too),
else the twin (`reference.hf_twin`) of the port model that read it. Two checkpoints are
compared only when their shapes agree (`shape_differences`); other config fields that differ
(`config_differences`) are compared anyway and reported as the likely causes of a FAIL.
transformers is passed in by the caller, never imported here.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, CheckpointFiles
from ..config import SHAPE_FIELDS, BertConfig

# config.json fields that do not change what `BertModel` computes in eval mode (labels, init,
# dropout, provenance): never listed as a likely cause of a difference between two checkpoints.
BOOKKEEPING_FIELDS = (
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "initializer_range",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "classifier_dropout",
    "architectures",
    "dtype",
    "torch_dtype",
    "transformers_version",
)


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


def shape_differences(ours: BertConfig, theirs: BertConfig) -> list[str]:
    """`field a vs b` for each `config.SHAPE_FIELDS` entry on which two configs differ: their
    weights cannot be compared tensor for tensor."""
    return [
        f"{name} {getattr(ours, name)!r} vs {getattr(theirs, name)!r}"
        for name in SHAPE_FIELDS
        if getattr(ours, name) != getattr(theirs, name)
    ]


def config_differences(ours: BertConfig, theirs: BertConfig) -> list[str]:
    """`field a vs b` for every other config field (HF's, or one only config.json has) on which
    two configs differ, BOOKKEEPING_FIELDS left out: the likely causes when their outputs differ."""
    a, b = ours.to_dict(), theirs.to_dict()
    skip = {*SHAPE_FIELDS, *BOOKKEEPING_FIELDS}
    skip |= {k for k in {*a, *b} if k.startswith("_")}  # _name_or_path and other local notes
    return [f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted({*a, *b} - skip) if a.get(k) != b.get(k)]


@contextlib.contextmanager
def quiet_transformers(transformers):
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


def _from_pretrained(source: Source, attn: str, **kwargs):
    from ..bert import BertModel

    files = source.files
    return BertModel.from_pretrained(
        files.weights_file,
        config_file=files.config_file,
        dtype=torch.float32,
        attn_implementation=attn,
        check_finite=source.check_finite,
        **kwargs,
    )


def load_port(source: Source, attn: str):
    """Our model in float32 on the CPU, and a note when it was loaded without its pooler."""
    model = _from_pretrained(source, attn)
    pooler = [k for k in model.loading_info["newly_initialized"] if k.startswith("pooler_dense.")]
    if not pooler:
        return model, None
    # e.g. a checkpoint saved from BertForMaskedLM, which has no pooler: a random one is no comparison
    model = _from_pretrained(source, attn, add_pooling_layer=False)
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


def _read_by_transformers(transformers, files: CheckpointFiles, attn: str, ours):
    """transformers' model of the class `ours` has (`hf_architecture`: BertModel, MegatronBertModel
    for a pre-LN config, RobertaModel, DistilBertModel, ... by model_type) as its own loader reads
    `files`, or None and why not."""
    kwargs = dict(dtype=torch.float32, attn_implementation=attn)
    if ours.config.family.pooler:  # DistilBertModel and ElectraModel take no add_pooling_layer
        kwargs["add_pooling_layer"] = ours.add_pooling_layer
    why = "transformers cannot read this file layout"
    with contextlib.ExitStack() as stack:
        try:
            view = _hf_view(files, stack)
            if view is not None:
                ref, info = getattr(transformers, ours.hf_architecture).from_pretrained(
                    str(view), local_files_only=True, output_loading_info=True, **kwargs
                )
                bad = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
                if not bad:
                    return ref.eval(), None
                why = f"transformers' own loader leaves {len(bad)} tensor(s) unloaded ({', '.join(bad[:4])})"
        except Exception as exc:  # noqa: BLE001  any failure of transformers' loader: fall back, and say so in the report
            why = f"transformers cannot read it ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None, why


def load_reference(
    transformers, ours, source: Source, attn: str, same_as_ours: bool = True
) -> tuple[torch.nn.Module, str]:
    """transformers' model (`ours.hf_architecture`) holding the weights of `source` (the checkpoint `ours` was
    loaded from, or with `same_as_ours=False` a reference checkpoint), and how it got them.

    Preferably transformers reads the checkpoint file itself, so that our key mapping is
    checked too. When it cannot (a layout it does not know, such as DDP `module.` keys), it
    is the twin (`reference.hf_twin`) of the port model that read those weights: the port's
    loader reads them, strictly, and the config is the checkpoint's own."""
    from bert_port.reference import hf_twin

    files = source.files
    ref, why = _read_by_transformers(transformers, files, attn, ours)
    if ref is not None:
        return ref, f"transformers.{ours.hf_architecture}.from_pretrained read {files.weights_file} itself"
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
        if donor.add_pooling_layer and not ours.add_pooling_layer:
            donor = _from_pretrained(source, attn, add_pooling_layer=False)
    return hf_twin(donor, attn).eval(), (
        f"transformers.{ours.hf_architecture}(config) given {whose} via hf_state_dict() (strict), because {why}; "
        "this checks the forward pass but not the key mapping"
    )

"""The HF <-> port key table, key normalisation, and the plan of a load.

Pure functions of names (and state dicts passed through untouched): no file I/O here. The
plan (`plan_load`) says, from a file's key names alone, what a load keeps under which port
name, what it renames, drops and skips; `account_keys`, the one place keys are accounted
(the loader uses it too), says given the model's keys what is missing, initialised afresh,
unexpected or fine to leave out; `LoadPlan.describe` puts that in words.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from ..storage.errors import CheckpointError, short_list
from .family_keys import DISTILBERT_TO_PORT, HEAD_TABLES

log = logging.getLogger(__name__)

# -----------------------------------------------------------------------------------------
# The key table: Hugging Face BertModel name -> port name, "{}" standing for the layer index.
# This is the only place names are spelled out; the inverse is derived from it.

HF_TO_PORT: dict[str, str] = {
    "embeddings.word_embeddings.weight": "word_embedding.weight",
    "embeddings.position_embeddings.weight": "pos_embedding.weight",
    "embeddings.token_type_embeddings.weight": "tk_type_embedding.weight",
    "embeddings.LayerNorm.weight": "embed_layer_norm.weight",
    "embeddings.LayerNorm.bias": "embed_layer_norm.bias",
    "encoder.layer.{}.attention.self.query.weight": "bert_layers.{}.self_attention.query.weight",
    "encoder.layer.{}.attention.self.query.bias": "bert_layers.{}.self_attention.query.bias",
    "encoder.layer.{}.attention.self.key.weight": "bert_layers.{}.self_attention.key.weight",
    "encoder.layer.{}.attention.self.key.bias": "bert_layers.{}.self_attention.key.bias",
    "encoder.layer.{}.attention.self.value.weight": "bert_layers.{}.self_attention.value.weight",
    "encoder.layer.{}.attention.self.value.bias": "bert_layers.{}.self_attention.value.bias",
    "encoder.layer.{}.attention.output.dense.weight": "bert_layers.{}.attention_dense.weight",
    "encoder.layer.{}.attention.output.dense.bias": "bert_layers.{}.attention_dense.bias",
    "encoder.layer.{}.attention.output.LayerNorm.weight": "bert_layers.{}.attention_layer_norm.weight",
    "encoder.layer.{}.attention.output.LayerNorm.bias": "bert_layers.{}.attention_layer_norm.bias",
    "encoder.layer.{}.intermediate.dense.weight": "bert_layers.{}.interm_dense.weight",
    "encoder.layer.{}.intermediate.dense.bias": "bert_layers.{}.interm_dense.bias",
    "encoder.layer.{}.output.dense.weight": "bert_layers.{}.out_dense.weight",
    "encoder.layer.{}.output.dense.bias": "bert_layers.{}.out_dense.bias",
    "encoder.layer.{}.output.LayerNorm.weight": "bert_layers.{}.out_layer_norm.weight",
    "encoder.layer.{}.output.LayerNorm.bias": "bert_layers.{}.out_layer_norm.bias",
    # Pre-LN (Megatron-BERT, `BertConfig.pre_norm`): a LayerNorm before attention and one before
    # the feed-forward in each layer, one on the encoder's output, none on the embeddings.
    "encoder.layer.{}.attention.ln.weight": "bert_layers.{}.pre_attention_layer_norm.weight",
    "encoder.layer.{}.attention.ln.bias": "bert_layers.{}.pre_attention_layer_norm.bias",
    "encoder.layer.{}.ln.weight": "bert_layers.{}.pre_ffn_layer_norm.weight",
    "encoder.layer.{}.ln.bias": "bert_layers.{}.pre_ffn_layer_norm.bias",
    "encoder.ln.weight": "final_layer_norm.weight",
    "encoder.ln.bias": "final_layer_norm.bias",
    "pooler.dense.weight": "pooler_dense.weight",
    "pooler.dense.bias": "pooler_dense.bias",
    # ELECTRA: embeddings of embedding_size projected to hidden_size (`BertConfig.embedding_size`).
    "embeddings_project.weight": "embed_project.weight",
    "embeddings_project.bias": "embed_project.bias",
}

# The key table of each family (`families.Family.key_table`): RoBERTa, XLM-R and ELECTRA use
# BERT's names under their own wrapper prefix; DistilBERT has its own.
KEY_TABLES: dict[str, dict[str, str]] = {
    "bert": HF_TO_PORT,
    "roberta": HF_TO_PORT,
    "electra": HF_TO_PORT,
    "distilbert": DISTILBERT_TO_PORT,
}

INVERSE_TABLES: dict[str, dict[str, str]] = {name: {v: k for k, v in t.items()} for name, t in KEY_TABLES.items()}
for _name, _table in KEY_TABLES.items():
    if len(INVERSE_TABLES[_name]) != len(_table):
        raise ImportError(f"checkpoint key table {_name!r} must be one-to-one: two HF names map to one port name")
for _name, _heads in HEAD_TABLES.items():
    for _head, _table in _heads.items():
        if len(set(_table.values())) != len(_table):
            raise ImportError(f"head key table {_name!r}/{_head!r} must be one-to-one: two HF names map to one")
PORT_TO_HF: dict[str, str] = INVERSE_TABLES["bert"]

# Keys that real checkpoints carry and the encoder does not need. Buffers are accepted
# silently; pretraining heads are dropped and reported.
BUFFER_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids")
# The other families' MLM heads (RoBERTa's `lm_head`, DistilBERT's `vocab_*`, ELECTRA's generator).
DROPPED_PREFIXES = (
    "cls.predictions.",
    "cls.seq_relationship.",
    "lm_head.",
    "vocab_transform.",
    "vocab_layer_norm.",
    "vocab_projector.",
    "generator_predictions.",
    "generator_lm_head.",
)
# Wrappers that training code puts around a model: DDP, torch.compile, HF task models (each
# family's `Family.encoder_prefix`).
ENCODER_PREFIXES = ("bert.", "roberta.", "distilbert.", "electra.")
WRAPPER_PREFIXES = ("module.", "_orig_mod.", *ENCODER_PREFIXES)
# Keys of task heads that sit beside the encoder and keep their names in both layouts.
# Which model owns which head is said by the model classes (heads.py, classifier.py).
HEAD_PREFIXES = ("classifier.", "pre_classifier.", "qa_outputs.", "cls.", "discriminator_predictions.")

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _map_key(key: str, table: Mapping[str, str]) -> str | None:
    """Look `key` up in a `{}`-templated table; None when it has no entry."""
    match = _LAYER_INDEX.search(key)
    if match is None:
        return table.get(key)
    template = table.get(key[: match.start()] + ".{}." + key[match.end() :])
    return None if template is None else template.format(match.group(1))


# -----------------------------------------------------------------------------------------
# Normalisation


def _split_prefix(key: str) -> tuple[str, str]:
    """(wrapper prefixes, the rest): `module.bert.encoder...` -> (`module.bert.`, `encoder...`)."""
    prefix, stripped = "", True
    while stripped:
        stripped = False
        for wrapper in WRAPPER_PREFIXES:
            if key.startswith(wrapper):
                prefix, key, stripped = prefix + wrapper, key[len(wrapper) :], True
    return prefix, key


def normalize_hf_key(key: str) -> str:
    """Bring one incoming key to the bare HF BertModel name (`embeddings...`,
    `encoder.layer.N...`, `pooler...`): strip wrapper prefixes, rename the legacy
    TF-era `LayerNorm.gamma/beta` to `weight/bias`."""
    key = _split_prefix(key)[1]
    if key.endswith("LayerNorm.gamma"):
        key = key[: -len("gamma")] + "weight"
    elif key.endswith("LayerNorm.beta"):
        key = key[: -len("beta")] + "bias"
    return key


@dataclass(frozen=True)
class Layout:
    """How a checkpoint file spells HF names: the wrapper prefix before the encoder's keys
    (`bert.` in bert-base-uncased, `module.` from DDP, ...) and whether its LayerNorms use
    the TF-era `gamma`/`beta`. Sniffed from the file's keys, to name in an error a tensor
    the file lacks as the file would have named it."""

    prefix: str = ""
    legacy_layer_norm: bool = False
    table: str = "bert"  # the family's key table (KEY_TABLES)
    heads: Mapping[str, str] = field(default_factory=dict)  # the model's head names (`head_table`), HF -> port

    def spell(self, port_key: str) -> str:
        """The name a port key (without a task model's `bert.`) has in a file of this layout."""
        port_key = next((hf for hf, port in self.heads.items() if port == port_key), port_key)  # lm_head.*
        if port_key.startswith(HEAD_PREFIXES + DROPPED_PREFIXES):  # heads sit beside the encoder, not under its `bert.`
            parts = self.prefix.split(".")[:-1]  # "module.roberta." -> ["module", "roberta"]
            if parts and parts[-1] + "." in ENCODER_PREFIXES:
                parts.pop()
            return "".join(part + "." for part in parts) + port_key
        hf_key = _map_key(port_key, INVERSE_TABLES[self.table]) or port_key
        if self.legacy_layer_norm and hf_key.endswith(("LayerNorm.weight", "LayerNorm.bias")):
            hf_key = hf_key.rsplit(".", 1)[0] + (".gamma" if hf_key.endswith("weight") else ".beta")
        return self.prefix + hf_key


def detect_layout(keys: Iterable[str], table: str = "bert") -> Layout:
    """The layout of a file from its keys: the wrapper prefix most of its encoder keys carry
    (named by the family's key `table`), and gamma/beta when most of its LayerNorm keys use them."""
    prefixes: Counter[str] = Counter()
    legacy = modern = 0
    for raw in keys:
        prefix, rest = _split_prefix(raw)
        if _map_key(normalize_hf_key(rest), KEY_TABLES[table]) is not None:
            prefixes[prefix] += 1
        if rest.endswith(("LayerNorm.gamma", "LayerNorm.beta")):
            legacy += 1
        elif rest.endswith(("LayerNorm.weight", "LayerNorm.bias")):
            modern += 1
    prefix = prefixes.most_common(1)[0][0] if prefixes else ""
    return Layout(prefix=prefix, legacy_layer_norm=legacy > modern, table=table)


# -----------------------------------------------------------------------------------------
# The plan of a load


@dataclass(frozen=True)
class KeyAccount:
    """Where each key stands between a file and a model, in port names: what the model needs
    and the file lacks (`missing`), of those what the model initialises afresh
    (`initialised`), what the file has and the model does not take (`unexpected`), and of
    those what is fine to leave out (`unused`: a pooler or task head the model lacks)."""

    missing: list[str]
    initialised: list[str]
    unexpected: list[str]
    unused: list[str]


def account_keys(
    incoming: Iterable[str],
    expected: Iterable[str],
    init_if_missing: tuple[str, ...] = (),
    unused_ok: tuple[str, ...] = (),
) -> KeyAccount:
    """Account a load's keys once, for the loader and for `LoadPlan.describe`: `incoming` are
    the file's keys under port names, `expected` the model's, `init_if_missing` the prefixes
    of the model keys it initialises when absent, `unused_ok` the prefixes of file keys it
    may ignore. Lists keep the order of `expected` (missing) and `incoming` (unexpected)."""
    incoming, expected = list(incoming), list(expected)
    have, want = set(incoming), set(expected)
    absent = [k for k in expected if k not in have]
    initialised = [k for k in absent if k.startswith(init_if_missing)]
    surplus = [k for k in incoming if k not in want]
    unused = [k for k in surplus if k.startswith(unused_ok)]
    fresh, ignored = set(initialised), set(unused)
    return KeyAccount(
        missing=[k for k in absent if k not in fresh],
        initialised=initialised,
        unexpected=[k for k in surplus if k not in ignored],
        unused=unused,
    )


@dataclass
class LoadPlan:
    """What loading a file does with each of its keys, decided from the names alone.

    `sources` maps each key the load places (port name) to the key in the file; a key with
    no entry in the table is placed under its own name and listed in `unmapped`, so that the
    load's error can name it."""

    sources: dict[str, str] = field(default_factory=dict)  # port key -> the key in the file
    renamed: dict[str, str] = field(default_factory=dict)  # raw key -> HF name, where they differ
    dropped: list[str] = field(default_factory=list)  # pretraining heads, reported at INFO
    buffers: list[str] = field(default_factory=list)  # position_ids / token_type_ids buffers, skipped
    unmapped: list[str] = field(default_factory=list)  # keys with no entry in the table
    layout: Layout = field(default_factory=Layout)  # how the file spells names, for messages

    def missing(self, expected: Iterable[str]) -> list[str]:
        """The model keys (`expected`) this file has no tensor for."""
        return account_keys(self.sources, expected).missing

    def describe(self, expected: Collection[str] | None = None, init_if_missing: tuple[str, ...] = ()) -> str:
        """The plan in words, one line per kind of key. Given the model's keys (`expected`)
        and the prefixes it initialises afresh when absent, also what is missing, what is
        initialised and what the model does not take."""
        kept = [k for k in self.sources if k not in self.unmapped]
        lines = [
            f"kept:        {len(kept)} tensors under port names"
            + (f" (file layout: prefix {self.layout.prefix!r})" if self.layout.prefix else ""),
            f"renamed:     {len(self.renamed)} keys"
            + (f": {short_list([f'{a} -> {b}' for a, b in self.renamed.items()], 3)}" if self.renamed else ""),
            f"dropped:     {len(self.dropped)} pretraining-head tensors"
            + (f": {short_list(self.dropped, 5)}" if self.dropped else ""),
            f"skipped:     {len(self.buffers)} buffers" + (f": {short_list(self.buffers)}" if self.buffers else ""),
        ]
        if self.unmapped:
            lines.append(
                f"unmapped:    {len(self.unmapped)} keys with no entry in the table: {short_list(self.unmapped)}"
            )
        if expected is not None:
            account = account_keys(self.sources, expected, init_if_missing)
            for label, keys in (
                ("initialised", account.initialised),
                ("missing", account.missing),
                ("unexpected", account.unexpected),
            ):
                lines.append(f"{label + ':':<13}{len(keys)}" + (f": {short_list(keys)}" if keys else ""))
        return "\n".join(lines)


def plan_load(
    keys: Iterable[str], keep_heads: tuple[str, ...] = (), table: str = "bert", heads: Mapping[str, str] = {}
) -> LoadPlan:
    """The plan of loading a file with these keys (any HF layout: BertModel, BertFor*,
    bare sentence-transformers, legacy gamma/beta, wrapper prefixes). Task-head keys such
    as `classifier.*` keep their names. Pretraining-head keys (`cls.*`) are dropped unless
    they start with one of `keep_heads`, the heads of the model being loaded. `table` names the
    family's key table (`KEY_TABLES`: "distilbert" for DistilBERT's names), `heads` the names of the
    model's head where they are not BERT's (`head_table`: RoBERTa's `lm_head.*`)."""
    keys = list(keys)
    plan = LoadPlan(layout=dataclasses.replace(detect_layout(keys, table), heads=heads))
    for raw_key in keys:
        key = normalize_hf_key(raw_key)
        if key != raw_key:
            plan.renamed[raw_key] = key
        if key in BUFFER_KEYS:
            plan.buffers.append(raw_key)
            continue
        if key not in heads and key.startswith(DROPPED_PREFIXES) and not key.startswith(keep_heads):
            plan.dropped.append(raw_key)
            continue
        new_key = heads.get(key) or (key if key.startswith(HEAD_PREFIXES) else _map_key(key, KEY_TABLES[table]))
        if new_key is None:
            plan.unmapped.append(raw_key)
            new_key = raw_key  # kept under its own name so the load error can list it
        if new_key in plan.sources:
            raise CheckpointError(
                f"checkpoint has two tensors for {new_key!r} (one of them {raw_key!r}); "
                "it mixes layouts, so re-export it from its source"
            )
        plan.sources[new_key] = raw_key
    return plan


@dataclass
class Conversion(LoadPlan):
    """A plan carried out on a state dict: its tensors under port names (the same tensor
    objects, nothing copied)."""

    state_dict: dict[str, Tensor] = field(default_factory=dict)


def hf_to_port(
    state_dict: Mapping[str, Tensor],
    keep_heads: tuple[str, ...] = (),
    table: str = "bert",
    heads: Mapping[str, str] = {},
) -> Conversion:
    """Convert any HF BERT state dict (BertModel, BertForPreTraining, BertFor*, bare
    sentence-transformers, legacy gamma/beta) to port names, following `plan_load`."""
    plan = plan_load(state_dict, keep_heads, table, heads)
    out = Conversion(**vars(plan))
    out.state_dict = {port: state_dict[raw] for port, raw in plan.sources.items()}
    if out.dropped:
        log.info(
            "dropped %d pretraining-head tensors not used by the encoder: %s",
            len(out.dropped),
            ", ".join(sorted(out.dropped)),
        )
    return out


def port_to_hf(
    state_dict: Mapping[str, Tensor], encoder_prefix: str = "", table: str = "bert", heads: Mapping[str, str] = {}
) -> dict[str, Tensor]:
    """Inverse of `hf_to_port` for a port state dict. Encoder keys get the HF names of the
    family's key `table` with `encoder_prefix` (``""`` for BertModel, ``"bert."`` or the
    family's for task models); head keys keep their names, except those of `heads` (HF -> port, as
    `head_table` gives them), which get their HF names back."""
    out, head_names = {}, {port: hf for hf, port in heads.items()}
    for key, tensor in state_dict.items():
        if key in head_names:
            out[head_names[key]] = tensor
            continue
        if key.startswith(HEAD_PREFIXES):
            out[key] = tensor
            continue
        hf_key = _map_key(key, INVERSE_TABLES[table])
        if hf_key is None:
            raise KeyError(f"port key {key!r} has no entry in the key table {table!r} (checkpoint.KEY_TABLES)")
        out[encoder_prefix + hf_key] = tensor
    return out


# -----------------------------------------------------------------------------------------
# Layers


def layer_indices(state_dict: Iterable[str]) -> set[int]:
    """The encoder layer indices a state dict (any layout) has tensors for."""
    out = set()
    for raw in state_dict:
        match = re.match(r"(?:encoder|transformer)\.layer\.(\d+)\.", normalize_hf_key(raw))  # DistilBERT's too
        if match:
            out.add(int(match.group(1)))
    return out


def check_layer_count(state_dict: Iterable[str], num_hidden_layers: int, source: str) -> None:
    """Raise `CheckpointError` when the config asks for layers the checkpoint lacks, before any
    module is built: a config claiming 100000 layers would otherwise build them all, at a
    cost in time and memory that grows with the count, only to report every one missing.
    Layers the file has beyond the config's cost nothing to build against and are listed by
    the load's usual error."""
    have = layer_indices(state_dict)
    if set(range(num_hidden_layers)) <= have:
        return
    found = sorted(have)
    shown = (
        f"layers {short_list([str(i) for i in found], 10)}"
        if found
        else "no encoder layers (no key like encoder.layer.0.*)"
    )
    raise CheckpointError(
        f"cannot load {source}: config.json gives num_hidden_layers={num_hidden_layers}, but the checkpoint has "
        f"tensors for {shown} ({len(found)} in all). Check that the config belongs to these weights. "
        "Nothing was loaded"
    )

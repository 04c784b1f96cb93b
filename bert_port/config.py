"""`BertConfig`: the Hugging Face BERT configuration as a plain dataclass.

Field names and defaults are those of `transformers.BertConfig` (the bert-base-uncased
values), so a `config.json` written by Hugging Face reads in unchanged and is written back
unchanged: fields this port does not use are kept in `extra` and round-trip untouched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from .families import FAMILIES, Family, family_of

# Activations a config may name in `hidden_act`; the functions live in `utils.ACT2FN`.
# Kept here as names only so that validating a config needs no torch import.
SUPPORTED_ACTIVATIONS = (
    "gelu",
    "gelu_python",
    "gelu_new",
    "gelu_pytorch_tanh",
    "gelu_python_tanh",
    "gelu_fast",
    "gelu_accurate",
    "gelu_10",
    "quick_gelu",
    "relu",
    "relu2",
    "relu6",
    "leaky_relu",
    "silu",
    "swish",
    "tanh",
    "sigmoid",
    "mish",
    "linear",
    "hardswish",
    "laplace",
    "sqrtsoftplus",
)

ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "varlen")

# transformers' `model_type` of Megatron-BERT, the pre-LN BERT (`BertConfig.pre_norm`).
MEGATRON_MODEL_TYPE = "megatron-bert"

# Fields every BERT config.json must carry; the rest fall back to HF's defaults.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _is_number(value: Any) -> bool:
    """A finite int or float that is not a bool (JSON's Infinity and NaN parse as floats)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The fields that fix the shapes of the weights (and, with vocab_size, the tokenizer), each with
# the largest value a config may give: two configs that agree on them hold interchangeable
# weights. The bounds are far above any real BERT (bert-large: 24 layers, 1024 wide, 30522
# words) and keep a corrupt or hostile config.json (num_hidden_layers 10**30) from building
# anything huge: it fails here, before any tensor, list or set of that size exists. The layer
# bound is high enough for the loader's own "the checkpoint has only N layers" error.
SHAPE_LIMITS: dict[str, int] = {
    "vocab_size": 2**24,
    "hidden_size": 2**16,
    "num_hidden_layers": 2**20,
    "num_attention_heads": 2**16,
    "intermediate_size": 2**18,
    "max_position_embeddings": 2**20,
    "type_vocab_size": 2**16,
}
SHAPE_FIELDS = tuple(SHAPE_LIMITS)


class ConfigError(ValueError):
    """A BERT configuration that cannot describe a model this port can build."""


# The one runtime option, with its default. As transformers keeps `_attn_implementation`, it lives
# in a private attribute of the config, behind an attribute of the public name (`_RuntimeOption`):
# never a dataclass field, so never in `to_dict()` or config.json. The constructor, `from_dict`,
# `from_json_file` and `from_pretrained` take it as a keyword (`attn_implementation="eager"`), as
# transformers does. How fast the model runs (packing, kernels, batch invariance) is not the
# config's business: `bert_port.speed.optimize`.
RUNTIME_OPTIONS: dict[str, Any] = {"attn_implementation": "sdpa"}


def _check_runtime_option(name: str, value: Any) -> None:
    if name == "attn_implementation" and (not isinstance(value, str) or value not in ATTN_IMPLEMENTATIONS):
        raise ConfigError(f"attn_implementation {value!r} is unknown; use one of {ATTN_IMPLEMENTATIONS}")


def _label_ids(id2label: dict) -> dict[int, str]:
    """`id2label` with int keys (JSON's are strings), numbered 0..N-1: the classifier's outputs
    are the labels by position, so a gap leaves an output without a label and a label without one."""
    keys = sorted(map(str, id2label), key=lambda k: (len(k), k))
    if keys != [str(i) for i in range(len(keys))]:
        raise ConfigError(
            f"id2label must number its labels 0 to {len(keys) - 1} without gaps, got ids {', '.join(keys[:10])}"
            f"{' ...' if len(keys) > 10 else ''}; renumber them from 0 (and label2id to match)"
        )
    return {int(k): str(v) for k, v in id2label.items()}


def _refuse_model_type(model_type: Any) -> None:
    """A `model_type` outside the BERT family (`FAMILIES`) is refused in one line, never
    loaded as BERT: a model read with another's arithmetic loads every tensor and computes wrong
    outputs (RoBERTa read as BERT did, before its positions were computed)."""
    if model_type is None or (isinstance(model_type, str) and model_type in FAMILIES):
        return
    raise ConfigError(
        f"config.json gives model_type {model_type!r}, which this port cannot compute exactly (it is not a BERT "
        f"this port knows); it computes {', '.join(map(repr, FAMILIES))}: load this checkpoint with transformers"
    )


def _family_fields(data: dict[str, Any]) -> dict[str, Any]:
    """A family's config.json in BertConfig's names: DistilBERT's `dim` read as `hidden_size`,
    transformers' defaults where the family's differ from BERT's, the values its code fixes; the
    `model_type` an unambiguous `architectures` gives when it has none (`family_of`)."""
    try:
        family = family_of(data.get("model_type"), data.get("architectures"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if data.get("model_type") is None and data.get("architectures"):
        data = {**data, "model_type": family.model_type}
    renamed = {family.config_names.get(k, k): v for k, v in data.items()}
    return {**family.defaults, **renamed, **family.fixed}


def _check_model_type(data: dict[str, Any]) -> None:
    """A config.json whose `pre_norm` contradicts its `model_type` describes no model that
    both the port and transformers build the same way: refuse it, saying which to fix."""
    pre_norm, model_type = data.get("pre_norm"), data.get("model_type")
    if not isinstance(pre_norm, bool) or model_type not in ("bert", MEGATRON_MODEL_TYPE):
        return  # a pre_norm of the wrong type is `validate`'s to report; other model types say nothing
    if pre_norm != (model_type == MEGATRON_MODEL_TYPE):
        raise ConfigError(
            f"config.json gives pre_norm={str(pre_norm).lower()} and model_type {model_type!r}, which "
            f"transformers builds as a {'pre' if model_type == MEGATRON_MODEL_TYPE else 'post'}-LN model: "
            f"set model_type to {_model_type(pre_norm, None)!r} (or remove pre_norm if model_type is right)"
        )


def _model_type(pre_norm: bool, read: str | None) -> str:
    """The `model_type` a config.json is written with: transformers picks the architecture by
    it, so a pre-LN model is "megatron-bert" and a post-LN one keeps what was read ("bert")."""
    if pre_norm:
        return MEGATRON_MODEL_TYPE
    return "bert" if read in (None, MEGATRON_MODEL_TYPE) else read


class _RuntimeOption:
    """A runtime option on `BertConfig`: read and assigned as an attribute, validated on
    assignment, stored in a private attribute. Declared as a dataclass `InitVar` whose default
    is this descriptor, so that it is a constructor keyword (`BertConfig(...,
    attn_implementation="eager")`, as in transformers) but never a field: `to_dict()`, `==`
    and `repr` do not see it."""

    def __init__(self, name: str) -> None:
        self.name, self.private = name, f"_{name}"

    def __get__(self, config: BertConfig | None, owner: type | None = None) -> Any:
        if config is None:  # the class: the dataclass reads the default from here
            return RUNTIME_OPTIONS[self.name]
        return config.__dict__.get(self.private, RUNTIME_OPTIONS[self.name])

    def __set__(self, config: BertConfig, value: Any) -> None:
        _check_runtime_option(self.name, value)
        config.__dict__[self.private] = value


@dataclass
class BertConfig:
    vocab_size: int = 30522  # WordPiece vocabulary (bert-base-uncased)
    hidden_size: int = 768  # width of every hidden state
    num_hidden_layers: int = 12  # transformer blocks
    num_attention_heads: int = 12  # heads per block; must divide hidden_size
    intermediate_size: int = 3072  # FFN inner width
    hidden_act: str = "gelu"  # FFN activation, HF ACT2FN name
    hidden_dropout_prob: float = 0.1  # dropout on embeddings and residual branches
    attention_probs_dropout_prob: float = 0.1  # dropout on attention probabilities
    max_position_embeddings: int = 512  # longest sequence the position table covers
    type_vocab_size: int = 2  # segment (token type) vocabulary
    initializer_range: float = 0.02  # std of the normal init
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"  # only "absolute" is supported
    is_decoder: bool = False  # causal self-attention when True
    add_cross_attention: bool = False  # not supported; must stay False
    tie_word_embeddings: bool = True  # MLM/LM decoder weight is the word embedding; False: its own
    classifier_dropout: float | None = None  # head dropout; None -> hidden_dropout_prob
    # Pre-LN blocks as Megatron-BERT arranges them (transformers' MegatronBertModel, model_type
    # "megatron-bert", which implies it): x + f(LayerNorm(x)) around attention and around the
    # feed-forward, one LayerNorm on the encoder's output, none on the embeddings. The name is
    # transformers' own (XmodConfig.pre_norm). It changes the architecture and the checkpoint's
    # key names, so it is a config.json field, written as model_type "megatron-bert".
    pre_norm: bool = False
    # ELECTRA: the width of the embeddings, projected to hidden_size by a linear layer when they
    # differ (transformers' `embeddings_project`); None: hidden_size, no projection.
    embedding_size: int | None = None
    # Sequence classification (HF keeps these on every PreTrainedConfig).
    id2label: dict[int, str] | None = None
    label2id: dict[str, int] | None = None
    problem_type: str | None = None  # "single_label_classification" | "regression" | ...
    # Every config.json field this dataclass does not model, kept verbatim.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    # The runtime option (see RUNTIME_OPTIONS): a constructor keyword and attribute, never a field.
    # Attention: "eager" (transformers' eager maths, and the only one returning probabilities),
    # "sdpa" (F.scaled_dot_product_attention), or "varlen" (FlashAttention on the packed real
    # tokens of an optimized model where the hardware has it: CUDA, fp16/bf16, no dropout; SDPA elsewhere).
    attn_implementation: InitVar[str] = _RuntimeOption("attn_implementation")

    def __post_init__(self, attn_implementation: str) -> None:
        self.attn_implementation = attn_implementation  # validated on the way
        for name in ("id2label", "label2id"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ConfigError(f"{name} must be a JSON object, got {getattr(self, name)!r}")
        if self.id2label is not None:
            self.id2label = _label_ids(self.id2label)
        if self.label2id is None and self.id2label is not None:
            self.label2id = {v: k for k, v in self.id2label.items()}
        self.validate()

    # -- validation -------------------------------------------------------------------

    def validate(self) -> None:
        """Raise `ConfigError` naming every invalid field, with what to do about it."""
        problems = self._shape_problems() + self._type_problems() + self._support_problems()
        if problems:
            raise ConfigError("Invalid BERT config:\n  - " + "\n  - ".join(problems))

    def _shape_problems(self) -> list[str]:
        problems = []
        for name, limit in SHAPE_LIMITS.items():
            value = getattr(self, name)
            if name == "type_vocab_size" and value == 0 and not isinstance(value, bool):
                continue  # no token types (DistilBERT): the model has no token-type embedding
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
            elif value > limit:
                problems.append(
                    f"{name} is {value}, above the {limit} this port accepts: no real BERT is that large, so "
                    "config.json is damaged or belongs to another model; restore it from the original"
                )
        size = self.embedding_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= 2**16):
            problems.append(f"embedding_size must be a positive integer up to {2**16} or null, got {size!r}")
        if not problems and self.hidden_size % self.num_attention_heads != 0:
            problems.append(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        pad = self.pad_token_id
        if isinstance(pad, int) and isinstance(self.vocab_size, int) and not (0 <= pad < self.vocab_size):
            problems.append(f"pad_token_id {pad} is outside the vocabulary [0, {self.vocab_size})")
        return problems

    def _type_problems(self) -> list[str]:
        # JSON has true/false and numbers: a string "false" or a boolean where a number goes is
        # a broken config, not something to coerce ("false" is truthy, True == 1).
        problems = []
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and 0.0 <= value < 1.0):
                problems.append(f"{name} must be a number in [0, 1), got {value!r}")
        if not (_is_number(self.layer_norm_eps) and self.layer_norm_eps > 0):
            problems.append(f"layer_norm_eps must be a positive finite number, got {self.layer_norm_eps!r}")
        if not (_is_number(self.initializer_range) and self.initializer_range >= 0):
            problems.append(f"initializer_range must be a finite number >= 0, got {self.initializer_range!r}")
        problems += [
            f"{name} must be true or false, got {getattr(self, name)!r}"
            for name in ("is_decoder", "add_cross_attention", "pre_norm", "tie_word_embeddings")
            if not isinstance(getattr(self, name), bool)
        ]
        problems += [
            f"{name} must be a string, got {getattr(self, name)!r}"
            for name in ("hidden_act", "position_embedding_type")
            if not isinstance(getattr(self, name), str)
        ]
        if self.problem_type is not None and not isinstance(self.problem_type, str):
            problems.append(f"problem_type must be a string or null, got {self.problem_type!r}")
        if self.pad_token_id is not None and (
            isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int)
        ):
            problems.append(f"pad_token_id must be an integer or null, got {self.pad_token_id!r}")
        return problems

    def _support_problems(self) -> list[str]:
        problems = []
        if isinstance(self.hidden_act, str) and self.hidden_act not in SUPPORTED_ACTIVATIONS:
            problems.append(f"hidden_act {self.hidden_act!r} is unknown; use one of {', '.join(SUPPORTED_ACTIVATIONS)}")
        if isinstance(self.position_embedding_type, str) and self.position_embedding_type != "absolute":
            problems.append(
                f"position_embedding_type {self.position_embedding_type!r} is not supported "
                "(transformers 5 BERT supports only 'absolute')"
            )
        if self.pre_norm is True and self.family.model_type != MEGATRON_MODEL_TYPE:
            problems.append(f"pre_norm=true is Megatron-BERT's; a {self.family.model_type} model has none: remove it")
        if self.add_cross_attention is True:
            problems.append(
                "add_cross_attention=True is not supported: this port implements the BERT encoder and "
                "causal decoder without cross-attention (an encoder-decoder model)"
            )
        return problems

    # -- derived ----------------------------------------------------------------------

    @property
    def family(self) -> Family:
        """The model type this config describes (`FAMILIES`): Megatron-BERT when pre-LN,
        else the `model_type` read (BERT when none, or when an override made a Megatron one post-LN)."""
        read = self.extra.get("model_type")
        if self.pre_norm is True:
            return FAMILIES[MEGATRON_MODEL_TYPE]
        return family_of(None if read == MEGATRON_MODEL_TYPE else read)

    @property
    def max_sequence_length(self) -> int:
        """The longest input the position table covers: max_position_embeddings, less RoBERTa's
        pad_token_id + 1 positions that no token takes (its positions start after the padding index)."""
        offset = self.pad_token_id + 1 if self.family.positions_after_padding else 0
        return self.max_position_embeddings - offset

    @property
    def embedding_width(self) -> int:
        """The width of the embeddings: `embedding_size` (ELECTRA), else `hidden_size`."""
        return self.embedding_size or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_labels(self) -> int:
        return len(self.id2label) if self.id2label else 2

    # -- HF config.json ---------------------------------------------------------------

    @classmethod
    def field_names(cls) -> set[str]:
        """The names `from_dict` overrides may use: every field, `num_labels` and the runtime options."""
        return {f.name for f in dataclasses.fields(cls)} - {"extra"} | {"num_labels", *RUNTIME_OPTIONS}

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> BertConfig:
        """Build from a `config.json` dict; unknown keys go to `extra`, `overrides` win. The
        runtime option (`attn_implementation`) is set on the config, never
        kept as data."""
        if not isinstance(data, dict):
            raise ConfigError(f"a BERT config must be a JSON object, got {type(data).__name__}")
        _refuse_model_type(data.get("model_type"))
        data = _family_fields(data)
        if "pre_norm" not in overrides:  # an override sets the architecture, and model_type follows it
            _check_model_type(data)
        data = {**data, **overrides}
        runtime = {name: data.pop(name) for name in RUNTIME_OPTIONS if name in data}
        missing = [name for name in REQUIRED_FIELDS if name not in data]
        if missing:
            raise ConfigError(
                f"config is missing required field(s) {', '.join(missing)}; a BERT config.json "
                "must give at least " + ", ".join(REQUIRED_FIELDS)
            )
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs.setdefault("pre_norm", data.get("model_type") == MEGATRON_MODEL_TYPE)  # Megatron's config.json omits it
        try:
            # num_labels is not stored (it is len(id2label)), as in HF. Like HF, a num_labels
            # passed as an override replaces an id2label of another length.
            num_labels = data.get("num_labels")
            if num_labels is not None and (
                data.get("id2label") is None or ("num_labels" in overrides and len(data["id2label"]) != int(num_labels))
            ):
                kwargs["id2label"] = {i: f"LABEL_{i}" for i in range(int(num_labels))}
                kwargs.pop("label2id", None)
            # num_labels stays in extra only so that to_dict writes it back (as len(id2label)).
            extra = {k: v for k, v in data.items() if k not in known}
            config = cls(**kwargs, **runtime, extra=extra)
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError) as exc:  # e.g. a field of the wrong JSON type
            raise ConfigError(f"invalid BERT config: {type(exc).__name__}: {exc}") from exc
        config._keys_read = set(data) - set(overrides)
        return config

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` dict: HF's fields, then every unknown field that was read."""
        out: dict[str, Any] = dict(self.extra)
        read = getattr(self, "_keys_read", set())
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            # None unless the model is a classifier: written only when the config.json read had them.
            if value is None and f.name in ("id2label", "label2id", "problem_type") and f.name not in read:
                continue
            # The default (tied), which most config.json files leave out: written when read or untied.
            if f.name == "tie_word_embeddings" and value is True and f.name not in read:
                continue
            if f.name == "embedding_size" and value is None:
                continue  # ELECTRA's field: written only when it has one
            if f.name == "id2label" and value is not None:
                value = {str(k): v for k, v in value.items()}
            out[f.name] = value
        if "num_labels" in out:
            out["num_labels"] = self.num_labels
        if not self.pre_norm and "pre_norm" not in read:
            del out["pre_norm"]  # written when true, or when read: a BERT's config.json stays as it was
        out["model_type"] = _model_type(self.pre_norm, out.get("model_type"))
        return self._in_family_names(out, read)

    def _in_family_names(self, out: dict[str, Any], read: set[str]) -> dict[str, Any]:
        """`out` (BertConfig's names) as the family's config.json spells it: DistilBERT's `dim`, no
        field its code fixes, and no BERT field it did not read that is at BERT's default."""
        family = self.family
        if family.model_type in ("bert", MEGATRON_MODEL_TYPE):
            return out
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        names = {v: k for k, v in family.config_names.items()}
        return {
            names.get(k, k): v
            for k, v in out.items()
            if k not in family.fixed and (k in read or k not in defaults or v != defaults[k])
        }

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, **overrides: Any) -> BertConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no config file at {path}; a checkpoint directory needs a config.json") from None
        except OSError as exc:  # permissions, a directory named config.json, an I/O error
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}; check that you may read it") from None
        except RecursionError:  # JSON nested thousands deep
            raise ConfigError(f"{path} is nested too deeply to be a config; restore it from the original") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint") from None
        try:
            return cls.from_dict(data, **overrides)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

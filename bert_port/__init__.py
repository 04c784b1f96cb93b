"""bert_port: a from-scratch PyTorch BERT that loads and saves Hugging Face checkpoints."""

# `loading` and `saving` give every port model its from_pretrained / save_pretrained methods
# when imported (see base_bert); importing them here makes that true after any import of bert_port.
from . import loading, saving  # noqa: F401
from .base_bert import BertPreTrainedModel
from .bert import BertLayer, BertModel, BertSelfAttention
from .cache import KVCache
from .checkpoint import CheckpointError
from .classifier import BertForSequenceClassification
from .config import BertConfig, ConfigError
from .discriminator import ElectraForPreTraining
from .heads import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForTokenClassification,
    BertLMHeadModel,
)
from .outputs import ModelOutput
from .packing import Packing
from .sentence import SentenceEncoder
from .tokenization import BatchEncoding, TokenizerError, encode, load_tokenizer
from .utils import get_extended_attention_mask

__all__ = [
    "BatchEncoding",
    "BertConfig",
    "BertForMaskedLM",
    "BertForPreTraining",
    "BertForQuestionAnswering",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertLMHeadModel",
    "BertLayer",
    "BertModel",
    "BertPreTrainedModel",
    "BertSelfAttention",
    "CheckpointError",
    "ConfigError",
    "ElectraForPreTraining",
    "KVCache",
    "ModelOutput",
    "Packing",
    "SentenceEncoder",
    "TokenizerError",
    "encode",
    "get_extended_attention_mask",
    "load_tokenizer",
]

"""bert_port: a from-scratch PyTorch BERT that loads and saves Hugging Face checkpoints."""

from .base_bert import BertPreTrainedModel
from .bert import BertLayer, BertModel, BertSelfAttention
from .checkpoint import CheckpointError
from .classifier import BertForSequenceClassification
from .config import BertConfig, ConfigError
from .outputs import ModelOutput
from .packing import Packing
from .tokenization import TokenizerError, encode, load_tokenizer
from .utils import get_extended_attention_mask

__all__ = [
    "BertConfig",
    "BertForSequenceClassification",
    "BertLayer",
    "BertModel",
    "BertPreTrainedModel",
    "BertSelfAttention",
    "CheckpointError",
    "ConfigError",
    "ModelOutput",
    "Packing",
    "TokenizerError",
    "encode",
    "get_extended_attention_mask",
    "load_tokenizer",
]

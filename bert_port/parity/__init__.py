"""Layer-by-layer parity of the port with a reference BERT, and the report.

`compare` runs our model and a reference model on the same batches and measures, at every
*site* (the embedding output, each layer's hidden state, `last_hidden_state` and
`pooler_output`), how far apart they are. The reference is any module that takes the same
inputs and returns `hidden_states` (embeddings first) and `pooler_output` with
`output_hidden_states=True`: `transformers.BertModel`, another port, or a test double. An
optional third model, the reference under the other attention implementation, gives the
*reference spread*: how far the reference is from itself when only the attention kernel
changes. The tolerances are the project's policy (`tolerance.py`); the report prints
that spread beside our difference.

`check_matrix` repeats `compare` per device and dtype; `format_report`, `report_to_json`
and `plot_report` present the result. Nothing here imports `transformers` at import time:
`sources` builds the reference from a checkpoint when the CLI (`bert_port/cli/parity.py`)
passes it the module, and everything else takes the reference as an argument.

One job per module: `inputs` (the texts and batches), `compare` (the statistics, the sites,
the device x dtype matrix), `report` (terminal, JSON, plot), `sources` (the checkpoints a run
reads and transformers' model of the reference).
"""

from ..tolerance import TOLERANCES, Tolerance
from .compare import (
    DTYPES,
    REL_FLOOR,
    Report,
    Row,
    Site,
    Stats,
    check_matrix,
    compare,
    cuda_unavailable_reason,
    dtype_name,
    exact_float32,
)
from .inputs import DEFAULT_PAIRS, DEFAULT_TEXTS, Batch, adversarial_batches, build_batches, read_texts_file
from .report import describe_failure, format_report, plot_report, report_to_json

__all__ = [
    "DEFAULT_PAIRS",
    "DEFAULT_TEXTS",
    "DTYPES",
    "REL_FLOOR",
    "TOLERANCES",
    "Batch",
    "Report",
    "Row",
    "Site",
    "Stats",
    "Tolerance",
    "adversarial_batches",
    "build_batches",
    "check_matrix",
    "compare",
    "cuda_unavailable_reason",
    "describe_failure",
    "dtype_name",
    "exact_float32",
    "format_report",
    "plot_report",
    "read_texts_file",
    "report_to_json",
]

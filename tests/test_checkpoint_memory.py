"""The memory a load takes (`from_pretrained` of a bert-base-size safetensors file): no more
than transformers' own, measured in fresh processes in the same run. Not in the Makefile's
PARITY_TESTS: it measures memory, which no kernel family changes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIGS

from bert_port import BertConfig, BertModel

# Run in a fresh process per library: import it, reset the peak (writing 5 to clear_refs),
# load, and report the resident set before and the peak during the load, in KiB.
_LOAD_PEAK = """
import json, sys
if sys.argv[1] == "port":
    from bert_port import BertModel
else:
    from transformers import BertModel

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = kib("VmRSS:")
model = BertModel.from_pretrained(sys.argv[2])
print(json.dumps({"before": before, "peak": kib("VmHWM:")}))
"""
LOAD_MARGIN_MIB = 16  # allocator noise and the check's 4 MiB read buffer


def _load_peak_mib(which: str, directory: Path) -> float:
    result = subprocess.run([sys.executable, "-c", _LOAD_PEAK, which, str(directory)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    return (figures["peak"] - figures["before"]) / 1024


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak RSS")
def test_loading_bert_base_takes_no_more_memory_than_transformers(tmp_path):
    """Peak RSS added by `from_pretrained` of a bert-base-size safetensors file: the port's
    at most transformers' own (+ LOAD_MARGIN_MIB), measured in fresh processes in the same
    run, with the NaN/Inf check on (the default). The check reads the file in chunks rather
    than through the memory map, so no page of the weights stays resident."""
    config = BertConfig.from_json_file(CONFIGS / "bert-base-uncased.json")
    BertModel(config).save_pretrained(tmp_path)
    file_mib = (tmp_path / "model.safetensors").stat().st_size / 2**20
    port, hf = _load_peak_mib("port", tmp_path), _load_peak_mib("transformers", tmp_path)
    assert port <= hf + LOAD_MARGIN_MIB, f"port {port:.0f} MiB, transformers {hf:.0f} MiB"
    assert port < file_mib / 4, f"port {port:.0f} MiB for a {file_mib:.0f} MiB file: the weights were paged in"

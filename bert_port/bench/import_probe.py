"""Run by file path in a fresh process (`python .../import_probe.py port|transformers`):
seconds to import torch, then `bert_port` or `transformers.BertModel`; prints one JSON line.

It imports nothing of `bert_port` before the clock starts, which `python -m
bert_port.bench...` would (it imports the package first), so it is run by path, and it
imports only the standard library at the top.
"""

import json
import sys
import time

# Run by path, Python puts this file's folder first on sys.path; its siblings (load.py,
# profiling.py, ...) must not shadow top-level modules of the same names.
sys.path.pop(0)


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) == 2 else ""
    if kind not in ("port", "transformers"):
        sys.exit("usage: python import_probe.py port|transformers")
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    if kind == "port":
        import bert_port  # noqa: F401
    else:
        from transformers import BertModel  # noqa: F401
    t2 = time.perf_counter()
    print(
        json.dumps({"torch_s": t1 - t0, "package_s": t2 - t1, "transformers_imported": "transformers" in sys.modules})
    )


if __name__ == "__main__":
    main()

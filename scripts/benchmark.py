"""Speed of bert_port against transformers.BertModel and the peers (CTranslate2, ONNX Runtime,
sentence-transformers), side by side (see `--help`; the sections live in `bert_port/bench/`)."""

import sys

from bert_port.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())

"""Convert a BERT checkpoint to the clean HF safetensors layout (see `--help`)."""

import sys

from bert_port.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())

"""Speed of bert_port against transformers.BertModel, side by side (see `--help`)."""

import sys

from bert_port.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())

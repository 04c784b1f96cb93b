"""Parity check of bert_port against transformers.BertModel (see `--help`)."""

import sys

from bert_port.cli.parity import main

if __name__ == "__main__":
    sys.exit(main())

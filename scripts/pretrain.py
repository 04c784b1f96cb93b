"""Train a BERT language model on text, masked or causal (see `--help`; also `bert-port-pretrain`)."""

import sys

from bert_port.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())

"""Fine-tune a BERT checkpoint as a text classifier (see `--help`; also `bert-port-finetune`)."""

import sys

from bert_port.cli.finetune import main

if __name__ == "__main__":
    sys.exit(main())

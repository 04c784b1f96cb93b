"""Labels and probabilities for a file of texts from a fine-tuned model (see `--help`; also `bert-port-predict`)."""

import sys

from bert_port.cli.predict import main

if __name__ == "__main__":
    sys.exit(main())

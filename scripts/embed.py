"""`python scripts/embed.py ...` = `bert-port-embed ...`: embed a corpus into sharded files."""

import sys

from bert_port.cli.embed import command

if __name__ == "__main__":
    sys.exit(command())

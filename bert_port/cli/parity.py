"""`bert-port-parity`: compare the port with `transformers.BertModel` on a checkpoint."""

from __future__ import annotations

import argparse
import sys

import torch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A gripping, beautifully shot film that never lets go.",
    "I wouldn't recommend this restaurant to anyone.",
    "BERT encodes each token in the context of the whole sentence.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--atol", type=float, default=5e-6, help="max abs difference allowed on real tokens")
    args = parser.parse_args(argv)

    import transformers

    from bert_port import BertModel, CheckpointError, ConfigError, encode, load_tokenizer
    from bert_port.assets import minilm_dir

    path = args.checkpoint or str(minilm_dir())
    try:
        ours = BertModel.from_pretrained(path)
    except (CheckpointError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ref = transformers.BertModel.from_pretrained(str(ours.source_dir)).eval()
    batch = encode(load_tokenizer(ours.source_dir), SENTENCES)
    with torch.no_grad():
        a, b = ours(**batch), ref(**batch)
    real = batch["attention_mask"].bool()
    diff_h = (a.last_hidden_state - b.last_hidden_state).abs()[real]
    diff_p = (a.pooler_output - b.pooler_output).abs()
    ok = diff_h.max().item() <= args.atol and diff_p.max().item() <= args.atol
    print(f"checkpoint: {path}")
    print(f"last_hidden_state (real tokens): max abs {diff_h.max().item():.3e}  mean abs {diff_h.mean().item():.3e}")
    print(f"pooler_output:                   max abs {diff_p.max().item():.3e}  mean abs {diff_p.mean().item():.3e}")
    print("PASS" if ok else f"FAIL (tolerance {args.atol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

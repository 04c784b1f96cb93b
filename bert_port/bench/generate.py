"""Text generation: tokens per second of greedy `BertLMHeadModel.generate` with the KV cache
and without it (every step reruns the whole sequence), beside transformers' `generate` on
the same weights (sdpa), both ways, interleaved. The model is all-MiniLM-L6-v2 turned into a
decoder (`is_decoder=True`; its LM head, which the checkpoint lacks, initialised afresh: the
tokens mean nothing, the time is what counts), on left-padded MR sentences."""

from __future__ import annotations

import random
import statistics
from typing import Any

import torch

from .harness import interleave, mr_texts


def section_generate(args, device: torch.device, report) -> dict[str, Any]:
    from bert_port import BertLMHeadModel, encode, load_tokenizer
    from bert_port.assets import minilm_dir
    from bert_port.generation import as_prompts
    from bert_port.reference import hf_twin

    new_tokens, n_prompts = (4, 1) if args.quick else (32, 2)
    batch_sizes = (1,) if args.quick else (1, 8)
    reps = args.reps
    report.section(
        f"generation: all-MiniLM-L6-v2 as a decoder, greedy, {new_tokens} new tokens on left-padded MR prompts, "
        f"{reps} interleaved repetitions; generated tokens/s"
    )
    path = minilm_dir()
    ours = BertLMHeadModel.from_pretrained(path, is_decoder=True, device=device)
    ref = hf_twin(ours, "sdpa")
    tokenizer = load_tokenizer(path)
    rng = random.Random(args.seed)
    texts = mr_texts()

    def ours_generate(use_cache: bool):
        return lambda p: ours.generate(**p, max_new_tokens=new_tokens, use_cache=use_cache)

    def ref_generate(use_cache: bool):
        kwargs = dict(max_new_tokens=new_tokens, do_sample=False, use_cache=use_cache)  # no eos: all new_tokens
        return lambda p: ref.generate(**p, **kwargs)

    variants = {
        "port, KV cache": ours_generate(True),
        "port, no cache": ours_generate(False),
        "transformers (sdpa), KV cache": ref_generate(True),
        "transformers (sdpa), no cache": ref_generate(False),
    }
    result: dict[str, Any] = {"new_tokens": new_tokens, "reps": reps}
    for B in batch_sizes:
        prompts = [as_prompts(encode(tokenizer, rng.sample(texts, B))) for _ in range(n_prompts)]
        prompts = [{k: v.to(device) for k, v in p.items()} for p in prompts]
        same = all(
            torch.equal(variants["port, KV cache"](p), variants["transformers (sdpa), KV cache"](p)) for p in prompts
        )
        times = interleave(variants, prompts, reps, device, f"generate B={B}", seed=args.seed)
        result[f"batch {B}"] = _rows(times, B * new_tokens * len(prompts), same, B, report)
    return result


def _rows(times: dict[str, list[float]], tokens: int, same: bool, B: int, report) -> dict[str, Any]:
    """The table of one batch size: tokens/s of every variant, the cache's speed-up and the
    port against transformers, each the median of the per-repetition ratios."""

    def ratio(slow: str, fast: str) -> float:
        return statistics.median(s / f for s, f in zip(times[slow], times[fast]))

    rows = {name: {"tokens_per_s": tokens / statistics.median(ts), "seconds": ts} for name, ts in times.items()}
    report.line()
    report.table((f"batch {B}", "generated tokens/s"), ((name, f"{r['tokens_per_s']:.0f}") for name, r in rows.items()))
    out = {
        "rows": rows,
        "greedy_tokens_equal_transformers": same,
        "cache_speedup_port": ratio("port, no cache", "port, KV cache"),
        "cache_speedup_transformers": ratio("transformers (sdpa), no cache", "transformers (sdpa), KV cache"),
        "port_vs_transformers_cache": ratio("transformers (sdpa), KV cache", "port, KV cache"),
        "port_vs_transformers_no_cache": ratio("transformers (sdpa), no cache", "port, no cache"),
    }
    report.line(
        f"KV cache speed-up: port {out['cache_speedup_port']:.2f}x, transformers "
        f"{out['cache_speedup_transformers']:.2f}x; port / transformers: {out['port_vs_transformers_cache']:.2f}x "
        f"with the cache, {out['port_vs_transformers_no_cache']:.2f}x without; greedy tokens equal "
        f"transformers': {'yes' if same else 'NO'}"
    )
    return out

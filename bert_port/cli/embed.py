"""`bert-port-embed`: sentence embeddings of a whole corpus, as the checkpoint's
sentence-transformers pipeline computes them, into sharded safetensors files.

    bert-port-embed --model path/to/checkpoint corpus.jsonl out/
    torchrun --nproc_per_node 4 -m bert_port.cli.embed --model ... corpus.jsonl out/

INPUT is JSONL (`id`, `text`, optionally a pair field), CSV/TSV with a header row, or plain
text, one text per line (ids are line numbers). OUTPUT receives `shard-NNNNN.safetensors`
(`embeddings`, (n, D)) with `shard-NNNNN.ids.json`, `index.json` and `truncated.json`; read
them back with `bert_port.embed.read_embeddings(OUTPUT)`. Rerunning a killed run in the same
folder keeps its finished shards.
"""

from __future__ import annotations

import argparse
import logging
import sys

from bert_port.cli import add_threads_flag, disk_full, disk_full_line, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bert-port-embed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("input", help="texts to embed: .jsonl, .csv, .tsv or .txt (one text per line)")
    p.add_argument("output", help="output folder (created if missing)")
    p.add_argument(
        "--model", required=True, help="sentence-transformers checkpoint folder, or a model id in the HF cache"
    )
    p.add_argument("--id-column", default="id", help="JSONL field or CSV/TSV column of the ids (default 'id')")
    p.add_argument("--text-column", default="text", help="field or column of the texts (default 'text')")
    p.add_argument("--pair-column", default=None, help="field or column of a second segment, if any")
    p.add_argument(
        "--batch-tokens", type=positive_int, default=4096, help="padded tokens per forward pass (default 4096)"
    )
    p.add_argument("--sort-window", type=positive_int, default=4096, help="texts sorted by length together")
    p.add_argument("--shard-size", type=positive_int, default=10000, help="texts per output file (default 10000)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="dtype of the stored embeddings")
    p.add_argument("--prompt", default=None, help="text prepended to every input, e.g. 'query: '")
    p.add_argument("--prompt-name", default=None, help="a prompt of the checkpoint's config_sentence_transformers.json")
    p.add_argument(
        "--device", default="auto", help="'auto' (the GPU if any), 'cpu', 'cuda' or 'cuda:N'; torchrun: cuda:LOCAL_RANK"
    )
    p.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="int8: the encoder's dense layers in int8 (CPU only; bert_port.speed); default float",
    )
    add_threads_flag(p)
    p.add_argument("--overwrite", action="store_true", help="replace another run's embeddings in OUTPUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _device(spec: str) -> str:
    """Under torchrun each rank takes its own GPU (LOCAL_RANK) when asked for 'cuda'."""
    import os

    if spec in ("cuda", "auto") and "LOCAL_RANK" in os.environ:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{os.environ['LOCAL_RANK']}"
    return spec


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bert_port.checkpoint import CheckpointError
    from bert_port.embed import Columns, EmbedError, Options, execute, prepare
    from bert_port.embed.run import world
    from bert_port.threads import cap_tokenizer_pool

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cap_tokenizer_pool()  # before the first text is tokenized: the pool is sized once
    columns = Columns(args.id_column, args.text_column, args.pair_column)
    opts = Options(
        batch_tokens=args.batch_tokens,
        sort_window=args.sort_window,
        shard_size=args.shard_size,
        dtype=args.dtype,
        prompt=args.prompt,
        prompt_name=args.prompt_name,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        device=_device(args.device),
        quantization=args.quantization,
        threads=args.threads,
    )
    try:
        job = prepare(args.model, args.input, args.output, columns, opts)
    except (EmbedError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = execute(job)
    except OSError as exc:  # the machine, not the input; finished shards are kept
        if disk_full(exc):
            print(
                disk_full_line(exc, args.output, "every finished shard is kept, and a rerun resumes"), file=sys.stderr
            )
            return 2
        print(f"error: cannot write {args.output}: {exc}; free space or fix permissions and rerun", file=sys.stderr)
        return 1
    if world()[0] == 0:
        s = summary
        print(
            f"wrote {s.texts} embeddings ({s.dim} dims, {s.dtype}) in {s.shards} shards to {args.output} "
            f"({s.reused} shards kept from an earlier run; {s.tokens} tokens in {s.seconds:.1f} s)"
        )
        print(f"truncated to {job.encoder.max_seq_length} tokens: {s.truncated} texts (ids in {s.truncated_file})")
    return 0


def command() -> int:
    """The `bert-port-embed` command: `main` in a process of its own, where large blocks are
    mapped apart so that the peak memory stays flat over a long corpus (`kernels.map_large_blocks`)."""
    from bert_port.speed import kernels

    kernels.map_large_blocks()
    return main()


if __name__ == "__main__":
    sys.exit(command())

"""What int8's float32 LayerNorm channels cost in speed: all-MiniLM-L6-v2 loaded in int8 twice in
one process, with `LN_FLOAT_CHANNELS` (2, the default) and with none, timed interleaved on the
bench's 8 random MR batches of 32; the median of the per-repetition time ratios.

    python scripts/measure_int8_float_channels.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bert_port import BertModel, load_tokenizer
from bert_port.assets import minilm_dir
from bert_port.bench.harness import mr_batches
from bert_port.speed import quantization


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    for channels in (quantization.LN_FLOAT_CHANNELS, 0):
        quantization.LN_FLOAT_CHANNELS = channels  # read when the layers are calibrated, at load
        models[channels] = BertModel.from_pretrained(minilm_dir(), quantization="int8").eval()
    batches = mr_batches(load_tokenizer(minilm_dir()), 8, 32, 0, torch.device("cpu"))
    times: dict[int, list[float]] = {n: [] for n in models}
    with torch.inference_mode():
        for model in models.values():  # warm-up: oneDNN builds its kernels per shape
            for batch in batches:
                model(**batch)
        for rep in range(args.reps):
            for n in list(models) if rep % 2 == 0 else list(models)[::-1]:
                start = time.perf_counter()
                for batch in batches:
                    models[n](**batch)
                times[n].append(time.perf_counter() - start)
    with_channels, without = (times[n] for n in models)
    ratio = statistics.median(a / b for a, b in zip(with_channels, without))
    print(f"{args.threads} thread(s): time with float channels / without, median of {args.reps}: {ratio:.3f}")


if __name__ == "__main__":
    main()

"""A soak of `bert-port-serve`: concurrency 32 for minutes, and the server's memory after it
against its memory after warm-up, with every failed request counted by kind.

    python -m bert_port.bench.serving_soak --seconds 300 --concurrency 32 --threads 2

Memory is the server process's resident set (VmRSS, /proc) sampled every 10 s; the verdict
line reads the last sample over the first one taken after the warm-up.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from .serving_load import make_requests, measure, text_pool, warm_up
from .serving_procs import port_spec, running

log = logging.getLogger(__name__)
SAMPLE_S = 10.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def soak(model_dir: Path, seconds: float, concurrency: int, threads: int, quantization: str | None = None) -> dict:
    """Run the soak; the RSS samples (MiB), requests answered and failures by kind."""
    import asyncio

    pools = text_pool()
    with running(port_spec(model_dir, threads, quantization), threads) as (base, pid):
        url = base + "/v1/embeddings"
        asyncio.run(warm_up(url, make_requests(64, seed=1, pools=pools), timeout_s=120))
        samples, answered, errors = [rss_mib(pid)], 0, {}
        end = time.monotonic() + seconds
        seed = 2
        while time.monotonic() < end:
            step = min(SAMPLE_S, end - time.monotonic())
            result = measure(url, make_requests(4000, seed=seed, pools=pools), concurrency, step, timeout_s=120)
            seed += 1
            answered += len(result.latencies)
            for kind, n in result.errors.items():
                errors[kind] = errors.get(kind, 0) + n
            samples.append(rss_mib(pid))
            log.info("%.0f s: %d answered, RSS %.1f MiB", seconds - (end - time.monotonic()), answered, samples[-1])
    return {"rss_mib": samples, "answered": answered, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    from bert_port.assets import minilm_dir

    p = argparse.ArgumentParser(prog="python -m bert_port.bench.serving_soak", description=__doc__)
    p.add_argument("--model", default=None, help="the model folder (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--seconds", type=float, default=300.0, help="length of the soak (default 300)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent clients (default 32)")
    p.add_argument("--threads", type=int, default=2, help="the server's threads (default 2)")
    p.add_argument("--quantization", choices=("int8",), default=None, help="serve the int8 model")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    out = soak(Path(args.model or minilm_dir()), args.seconds, args.concurrency, args.threads, args.quantization)
    rss = out["rss_mib"]
    print(
        f"RSS after warm-up {rss[0]:.1f} MiB, after {args.seconds:g} s at concurrency {args.concurrency} {rss[-1]:.1f} MiB"
    )
    print(
        f"ratio {rss[-1] / rss[0]:.3f} (peak {max(rss):.1f} MiB); {out['answered']} requests answered; failures {out['errors'] or 0}"
    )
    return 0 if not any(k.startswith("5") for k in out["errors"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

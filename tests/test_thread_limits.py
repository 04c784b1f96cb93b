"""Thread counts follow the CPUs the process may use: its affinity (`taskset`) and its cgroup
CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`), read from cgroup files
planted in a temporary folder; a `--threads` or `RAYON_NUM_THREADS` above them is capped, with
one line that says so, instead of exhausting the process's threads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from bert_port import threads
from bert_port.threads import cgroup_cpu_limit, governed, usable_cpus


def _plant(root, membership: str, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "self-cgroup").write_text(membership)
    return root / "self-cgroup"


def test_a_cgroup_v2_quota_of_half_a_cpu_leaves_one_thread(tmp_path):
    member = _plant(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"})
    assert cgroup_cpu_limit(tmp_path, member) == 0.5
    assert usable_cpus(tmp_path, member) == 1


def test_the_tightest_quota_above_the_process_binds(tmp_path):
    member = _plant(
        tmp_path,
        "0::/job.slice/run.scope\n",
        {"job.slice/run.scope/cpu.max": "max 100000\n", "job.slice/cpu.max": "150000 100000\n"},
    )
    assert cgroup_cpu_limit(tmp_path, member) == 1.5
    assert usable_cpus(tmp_path, member) == min(2, len(os.sched_getaffinity(0)))


def test_cgroup_v1_quota_is_read_and_minus_one_is_none(tmp_path):
    files = {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "25000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    }
    member = _plant(tmp_path, "12:cpu,cpuacct:/docker/abc\n0::/\n", files)
    assert cgroup_cpu_limit(tmp_path, member) == 0.25
    (tmp_path / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path, member) is None


def test_no_quota_leaves_the_affinity(tmp_path):
    member = _plant(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(tmp_path, member) is None
    assert usable_cpus(tmp_path, member) == len(os.sched_getaffinity(0))
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent") is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_affinity_narrows_the_usable_cpus_and_the_governor():
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert usable_cpus() == 1
        assert threads.ThreadGovernor().max_threads == 1
    finally:
        os.sched_setaffinity(0, before)


def test_a_fixed_count_above_the_cpus_is_capped_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(threads, "_WARNED", set())  # a fresh process's record of what it said
    before, model = torch.get_num_threads(), torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="bert_port.threads"):
        for _ in range(3):  # as a server sets it for each batch
            with governed(model, 100000):
                assert torch.get_num_threads() == usable_cpus()
    assert torch.get_num_threads() == before
    assert len(caplog.records) == 1
    assert "--threads 100000 is more than" in caplog.text and f"using {usable_cpus()}" in caplog.text


@pytest.mark.parametrize(
    "flags, env, said",
    [(["--threads", "100000"], {}, "--threads 100000"), (["--threads", "1"], {"RAYON_NUM_THREADS": "100000"}, "RAYON")],
)
def test_embed_with_far_too_many_threads_runs_and_says_so_in_one_line(minilm_path, tmp_path, flags, env, said):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": f"text number {i}"}) + "\n" for i in range(4)))
    done = subprocess.run(
        [sys.executable, "-m", "bert_port.cli.embed", str(src), str(tmp_path / "out")]
        + ["--model", str(minilm_path), "--no-progress", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and f"using {usable_cpus()}" in lines[0], done.stderr[-2000:]
    assert "wrote 4 embeddings" in done.stdout

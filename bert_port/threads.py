"""A thread count that follows the CPUs other processes leave free (`--threads auto`, the default).

torch waits at the end of each parallel region for its slowest thread: when another process
holds one of the cores, every region waits for the thread on it. `ThreadGovernor` reads how much
CPU time the other processes took on this process's CPUs (/proc/stat less this process's own,
`os.times`) and sets the thread count, between batches, to the cores they left; `governed` steps
it before each forward of a model. No count goes above the CPUs the process may use
(`usable_cpus`: its affinity, and its cgroup's CPU quota, which `os.cpu_count` and the
affinity do not show): a fixed count above them is capped with a warning. Why it is the
default, and when to fix a count instead: docs/architecture.md ("Thread governor");
tests/test_threads.py checks that the count does not change the bits on the CPU it runs on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import torch

TAKEN = 0.25  # share of a core other processes must have used for it to count as taken
INTERVAL_S = 0.5  # how often the load is read again
CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")

log = logging.getLogger(__name__)


def _own_cgroups(membership: Path) -> dict[str, str]:
    """This process's cgroup per hierarchy, from /proc/self/cgroup: "" for cgroup v2's unified
    one (`0::/path`), "cpu" for v1's CPU controller (`4:cpu,cpuacct:/path`)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return {}
    own = {}
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            own[""] = path
        elif "cpu" in controllers.split(","):
            own["cpu"] = path
    return own


def _up_from(mount: Path, path: str) -> list[Path]:
    """`mount/path` and each folder above it up to `mount`: a quota on any of them binds. Inside
    a container the path can be the host's, absent here: the folders that exist are read."""
    leaf = mount / path.lstrip("/")
    return [p for p in (leaf, *leaf.parents) if p.is_relative_to(mount) and p.is_dir()]


def _quota(folder: Path) -> float | None:
    """The CPU quota of one cgroup folder in CPUs, None where it sets none: v2's `cpu.max`
    ("QUOTA PERIOD", or "max PERIOD"), else v1's `cpu.cfs_quota_us` over `cpu.cfs_period_us`
    (quota -1: none)."""
    try:
        if (folder / "cpu.max").is_file():
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        elif (folder / "cpu.cfs_quota_us").is_file():
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        else:
            return None
        return None if quota == "max" or int(quota) <= 0 else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):  # unreadable or not a quota: no limit known
        return None


def cgroup_cpu_limit(root: str | os.PathLike = CGROUP_ROOT, membership: str | os.PathLike = MEMBERSHIP) -> float | None:
    """The CPUs the cgroup quota lets this process use (0.5 under `cpu.max` "50000 100000"), the
    smallest quota of its cgroup and those above it, on cgroup v2 (`root`/...) or v1's CPU
    controller (`root`/cpu/...); None without a quota. `membership` is /proc/self/cgroup."""
    root = Path(root)
    own = _own_cgroups(Path(membership))
    folders = _up_from(root, own[""]) if "" in own else []
    if "cpu" in own:
        for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
            if mount.is_dir():
                folders += _up_from(mount, own["cpu"])
                break
    quotas = [q for q in map(_quota, folders) if q is not None]
    return min(quotas) if quotas else None


def usable_cpus(root: str | os.PathLike = CGROUP_ROOT, membership: str | os.PathLike = MEMBERSHIP) -> int:
    """How many CPUs this process may keep busy: those its affinity allows (`taskset`), at most
    its cgroup quota rounded up, at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root, membership)
    return max(1, min(cpus, math.ceil(limit)) if limit is not None else cpus)


_WARNED: set[tuple[str, int, int]] = set()


def capped(threads: int, flag: str = "--threads") -> int:
    """`threads`, or the CPUs this process may use when it asks for more (`usable_cpus`), said in a
    warning: threads beyond them only wait for each other, and tens of thousands exhaust the
    process's threads (the tokenizer's thread pool then fails to start)."""
    usable = usable_cpus()
    if threads <= usable:
        return threads
    if (flag, threads, usable) not in _WARNED:  # once: a server or an encode loop sets it per batch
        _WARNED.add((flag, threads, usable))
        log.warning(
            "%s %d is more than the %d CPU(s) this process may use (its CPU affinity and cgroup quota); using %d",
            flag, threads, usable, usable,
        )  # fmt: skip
    return usable


def cap_tokenizer_pool() -> None:
    """Hold the tokenizer's thread pool (Rust's rayon, sized once, by `RAYON_NUM_THREADS` when set)
    to the CPUs this process may use. Call before the first tokenization; without the variable
    rayon sizes the pool to the CPUs itself."""
    given = os.environ.get("RAYON_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        os.environ["RAYON_NUM_THREADS"] = str(capped(int(given), "RAYON_NUM_THREADS"))


def _cpu_seconds(cpus: set[int]) -> float | None:
    """Busy CPU seconds of `cpus` since boot (all processes), from /proc/stat; None where
    there is no /proc/stat."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(f) for f in fields]
            busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), None once the
    process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a live process, 0 once it is gone."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids() -> list[int]:
    """The live child processes of this one (from /proc; empty without it)."""
    me = str(os.getpid())
    entries = Path("/proc").iterdir() if Path("/proc").is_dir() else ()
    return [int(e.name) for e in entries if e.name.isdigit() and (_stat_fields(e.name) or [None, None])[1] == me]


class ThreadGovernor:
    """Call `step()` before each batch: every `interval` seconds it sets torch's intra-op
    thread count to the cores of this process's CPUs that other processes left free (at
    least 1, at most `max_threads`, default the usable CPUs). `exclude` lists processes of the
    same job (workers), whose CPU time is not a neighbour's. Use it as a context manager to
    put the thread count back afterwards. Where /proc/stat is missing it does nothing."""

    def __init__(self, max_threads: int | None = None, interval: float = INTERVAL_S, exclude=()) -> None:
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.max_threads = max_threads or usable_cpus()
        self.interval = interval
        self.saved = torch.get_num_threads()
        self._last: tuple[float, float, float] | None = None
        self.threads = self.max_threads
        self.exclude = list(exclude)

    def others_load(self) -> float | None:
        """Cores' worth of CPU time other processes used on our CPUs since the last call
        (None on the first call, or without /proc/stat)."""
        busy = _cpu_seconds(self.cpus)
        if busy is None:
            return None
        own = os.times()
        now = (time.monotonic(), busy, own.user + own.system + sum(map(_process_seconds, self.exclude)))
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:
            return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0]))

    def step(self) -> int:
        """The thread count for the next batch, set in torch."""
        if self._last is None or time.monotonic() - self._last[0] >= self.interval:
            others = self.others_load()
            if others is not None:
                taken = max(0, math.ceil(others - TAKEN))
                self.threads = max(1, min(self.max_threads, len(self.cpus) - taken))
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads

    def __enter__(self) -> Self:
        self.saved = torch.get_num_threads()
        return self

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.saved)


@contextlib.contextmanager
def governed(model: torch.nn.Module, threads: int | str | None) -> Iterator[None]:
    """For the duration: `threads` intra-op threads (a number); or "auto", a `ThreadGovernor`
    stepped before each forward of `model` (a pre-hook: one step a batch); None leaves torch's
    count. The thread count is put back afterwards."""
    if threads is None:
        yield
        return
    with ThreadGovernor() as governor:
        if threads == "auto":  # (a pre-hook that returned the count would replace the forward's arguments)
            handle = model.register_forward_pre_hook(lambda *_: governor.step() and None)
        else:
            torch.set_num_threads(capped(threads))
            handle = None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

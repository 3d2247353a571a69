"""How many threads torch computes with: by default, as many as the CPUs this process may use.

torch's own default counts the machine's cores, not those this process is given: in a container limited
by a cgroup quota, or pinned to a few CPUs (`taskset`, a scheduler's affinity), it starts more threads than
it can run at once, and they wait for one another. The default here is the affinity's CPU count, bounded by
the cgroup v2 `cpu.max` quota of this process's cgroup and its parents, and shared among the processes of
this machine under `accelerate launch` (LOCAL_WORLD_SIZE); OMP_NUM_THREADS, where set, says it instead.
This module imports no torch until it sets the threads, so that `--help` stays instant.

On a machine shared with other jobs, threads wait for CPUs that others hold: `oversubscription` says so in one
line, from the load average against the CPUs this process may use, or from the process's CPU time against the
wall time of its first step (a process given less than half a CPU), and suggests fewer threads.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from .errors import BadInput

__all__ = ["CpuClock", "default_threads", "environment_number", "load_average", "machine_cpus", "oversubscription",
           "quota_cpus", "use_threads"]

BUSY = 0.5  # CPUs a computing process is given, at the least, on a machine that is not oversubscribed


def machine_cpus() -> int:
    """The CPUs of this machine: the most threads a command computes with (more only wait for one another, and
    tens of thousands fail to start and crash the process)."""
    return os.cpu_count() or 1


def environment_number(name: str, default: int, maximum: int | None = None) -> int:
    """The positive whole number the environment variable `name` holds (`default` where unset or empty), or a
    ValueError naming the variable and what it takes."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1 or (maximum is not None and int(text) > maximum):
        at_most = f" of at most {maximum}" if maximum is not None else ""
        raise BadInput(f"the environment variable {name} must be a positive whole number{at_most}; got {text!r}")
    return int(text)


def quota_cpus(cgroup_root: str | os.PathLike = "/sys/fs/cgroup", own: str | os.PathLike = "/proc/self/cgroup") -> int | None:
    """The CPUs the cgroup v2 quota (`cpu.max`: QUOTA PERIOD, or max) allows this process, rounded up: the
    tightest of its cgroup's and its parents'. None where there is no quota, or no cgroup v2."""
    try:
        path = next(line[3:] for line in Path(own).read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    folder, bounds = Path(cgroup_root) / path.strip().lstrip("/"), []
    for parent in (folder, *folder.parents):
        try:
            quota, period = (parent / "cpu.max").read_text().split()[:2]
            if quota != "max":
                bounds.append(max(1, math.ceil(int(quota) / int(period))))
        except (OSError, ValueError):
            pass  # no cpu.max at this level (the root has none), or unreadable
        if parent == Path(cgroup_root):
            break
    return min(bounds, default=None)


def default_threads() -> tuple[int, str]:
    """(threads, where the number comes from): OMP_NUM_THREADS where set, else the CPUs this process may use
    (affinity, cgroup quota), shared among this machine's processes of a launch."""
    processes = environment_number("LOCAL_WORLD_SIZE", 1)  # checked whichever says the number
    variable = environment_number("OMP_NUM_THREADS", 0, machine_cpus())  # above the CPUs: refused, as --threads is
    if variable:
        return variable, "OMP_NUM_THREADS"
    cpus = _affinity_cpus()
    why = "the CPUs this process may use"
    quota = quota_cpus()
    if quota is not None and quota < cpus:
        cpus, why = quota, f"the cgroup's CPU quota, of the {cpus} CPUs this process may use"
    if processes > 1:
        return max(1, cpus // processes), f"{why}, shared by {processes} processes"
    return cpus, why


def use_threads(threads: int | None, option: str = "--threads") -> str:
    """Set torch's threads to `threads` (default: `default_threads`) and return the line that says so;
    ValueError for a number below 1 or above the machine's CPUs, naming `option` in the words of the command line's
    bound on --threads (checks/bounds.py's BOUNDS)."""
    cpus = machine_cpus()
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cpus):
        raise BadInput(f"{option} must be a positive integer up to {cpus} (this machine's CPUs); got {threads!r}")
    import torch

    why = option
    if threads is None:
        threads, why = default_threads()
    torch.set_num_threads(threads)
    return f"threads: {threads} ({why}; {option} N to change)"


def _affinity_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> float | None:
    """The machine's load average over the last minute: the processes running or waiting for a CPU. None where
    the system keeps none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


class CpuClock:
    """This process's CPU time against the wall time since it was made: how many CPUs it computed on."""

    def __init__(self):
        self.cpu, self.wall = time.process_time(), time.perf_counter()

    def cpus(self) -> float:
        return (time.process_time() - self.cpu) / max(time.perf_counter() - self.wall, 1e-9)


def oversubscription(threads: int, used_cpus: float, load: float | None = None, cpus: int | None = None) -> str | None:
    """One line when the machine looks oversubscribed, suggesting --threads; None when it does not.

    Its premises: the load average `load` above the `cpus` this process may use (default: its affinity's), or
    the process computing on fewer than `BUSY` CPUs (`used_cpus`, from a `CpuClock` around its work) with
    `threads` threads."""
    cpus = cpus or _affinity_cpus()
    crowded = load is not None and load > cpus
    if not crowded and used_cpus >= BUSY:
        return None
    seen = [f"load average {load:.1f} on the {cpus} CPU(s) this process may use" if crowded else "",
            f"its first step computed on {used_cpus:.1f} CPU(s) with {threads} thread(s)" if used_cpus < BUSY else ""]
    others = max(0.0, load - threads) if load is not None else threads / 2
    fewer = max(1, min(threads - 1, math.floor(cpus - others)))
    advice = (f"fewer threads may train faster: try --threads {fewer}" if threads > 1 else
              "other jobs hold the CPUs, so steps are slower and timings noisy (--threads N sets the threads)")
    return f"threads: the machine looks oversubscribed ({'; '.join(filter(None, seen))}): {advice}"

"""Driving benchmark child processes, and the memory readings they report.

A child prints `ready` once built, answers each `time` line with `ok` after
one timing of each of its configurations, and answers `result` with one JSON
line before exiting.
"""

import json
import pathlib
import time


def drive(children, rounds, cooldown_s=0.0):
    """Times `children` round-robin for `rounds` rounds; returns their JSON results.

    Args:
        children: `subprocess.Popen` objects (text pipes) that printed `ready`.
        rounds: timing rounds; each child times once per round.
        cooldown_s: pause before each child's timing, so that the previous
            child's spinning worker threads do not slow it down.
    """
    children = list(children)
    for _ in range(rounds):
        for child in children:
            time.sleep(cooldown_s)
            child.stdin.write("time\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "ok"
    results = []
    for child in children:
        child.stdin.write("result\n")
        child.stdin.flush()
        results.append(json.loads(child.stdout.readline()))
        child.wait()
    return results


def memory_mb(key, pid="self", path=None):
    """A memory figure of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`) or of
    `path` (`/proc/meminfo`), in MB; NaN where it cannot be read (the
    process has exited, or not Linux)."""
    try:
        for line in pathlib.Path(path or f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def reset_peak_memory():
    """Resets this process' peak RSS (`VmHWM`) counter (Linux: write 5 to clear_refs)."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass

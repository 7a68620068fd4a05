"""Driving benchmark child processes, and the memory readings they report.

A child prints `ready` once built, answers each `time` line with `ok` after
one timing of each of its configurations, and answers `result` with one JSON
line before exiting.
"""

import json
import pathlib
import sys
import time

import numpy as np


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


def answer(time_once, result):
    """The child's side of `drive`: says `ready`, then answers the parent on stdin.

    Args:
        time_once: called for each `time` line (one timing of everything the
            child hosts), answered with `ok`.
        result: called for the `result` line; its return value is printed as
            one JSON line, and the child stops listening.
    """
    print("ready", flush=True)
    for command in sys.stdin:
        if command.strip() == "time":
            time_once()
            print("ok", flush=True)
        elif command.strip() == "result":
            print(json.dumps(result()), flush=True)
            return


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


class StepTimer:
    """Times one compiled training step in a child: warm-up, then timed rounds.

    Args:
        run: runs one step (asynchronously where the framework allows).
        sync: waits for the steps in flight.
        max_steps: most steps in one timing.
    """

    def __init__(self, run, sync, max_steps=500):
        self.run, self.sync, self.max_steps = run, sync, max_steps
        for _ in range(3):  # compile and warm up
            run()
        sync()
        start = time.perf_counter()
        run()
        sync()
        self.probe_s = max(time.perf_counter() - start, 1e-5)
        self.step_ms = []

    def time(self, budget_s):
        """One timing of about `budget_s` seconds of steps (at least 3)."""
        steps = int(max(3, min(self.max_steps, budget_s / self.probe_s)))
        # Untimed steps first: this configuration's buffers back in cache, and
        # the cores awake again after the parent's pause between children.
        for _ in range(max(1, steps // 3)):
            self.run()
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.run()
        self.sync()
        self.step_ms.append((time.perf_counter() - start) / steps * 1e3)

    def stats(self):
        """Every timing, and their median, quartiles, min and max (ms per step)."""
        ms = np.asarray(self.step_ms)
        return {"step_ms": ms.tolist(), "median_ms": float(np.median(ms)),
                "p25_ms": float(np.percentile(ms, 25)), "p75_ms": float(np.percentile(ms, 75)),
                "min_ms": float(ms.min()), "max_ms": float(ms.max())}

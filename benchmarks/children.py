"""Driving benchmark child processes: interleaved timing rounds, then results.

A child prints `ready` once built, answers each `time` line with `ok` after
one timing of each of its configurations, and answers `result` with one JSON
line before exiting.
"""

import json
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

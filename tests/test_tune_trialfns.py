"""Trial functions that spawned tuner processes import by name (stdlib only, so spawn is cheap).

Not tests themselves; kept in a test_tune_* module so the tuner tests own them.
"""

import os
import subprocess
import sys
import time


def ok_trial(config):
    return {"throughput": float(config["x"]) * 2.0, "peak_memory_bytes": 100 * config["x"]}


def raising_trial(config):
    raise RuntimeError("boom in trial")


def hanging_trial(config):
    """Hangs, after starting a worker of its own (which the timeout must kill too)."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    if "tmp" in config:
        with open(os.path.join(config["tmp"], "worker.pid"), "w") as f:
            f.write(str(worker.pid))
    time.sleep(60)
    return {"throughput": 1.0}


def oom_trial(config):
    blob = bytearray(3 * 1024**3)  # beyond the RLIMIT_AS cap set by the evaluator
    return {"throughput": float(len(blob))}


def mixed_trial(config):
    """x=1 raises, x=2 hangs, x=3 allocates past the cap, others succeed."""
    x = config["x"]
    if x == 1:
        return raising_trial(config)
    if x == 2:
        return hanging_trial(config)
    if x == 3:
        return oom_trial(config)
    return ok_trial(config)

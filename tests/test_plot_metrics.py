#!/usr/bin/env python3
"""Tests of scripts/plot_metrics.py: a PNG from a run's metrics.jsonl (with a
resumed run's repeated step and a torn last line), and exit code 3 with a
message for a missing file, a file without train records, and a malformed
line that is not the last. Plain Python; exits 1 if any check fails.

    pip install -r scripts/requirements-plot.txt
    python3 tests/test_plot_metrics.py
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_metrics.py")
failures = 0


def check(name, ok, detail=""):
    global failures
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else ": " + detail))
    if not ok:
        failures += 1


def run(*args):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


with tempfile.TemporaryDirectory() as tmp:
    good = os.path.join(tmp, "good")
    os.makedirs(good)
    lines = []
    for step in range(1, 41):
        lines.append(json.dumps({"event": "train", "step": step, "loss": 5.0 - step * 0.05,
                                 "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0,
                                 "elapsed_s": step * 0.1}))
        if step % 10 == 0:
            lines.append(json.dumps({"event": "val", "step": step, "val_loss": 5.2 - step * 0.05}))
    lines.append(json.dumps({"event": "checkpoint", "step": 40, "stall_s": 0.01}))
    lines.append(json.dumps({"event": "train", "step": 40, "loss": 2.9}))  # resumed: again
    text = "\n".join(lines) + "\n" + '{"event": "train", "st'  # torn last line
    with open(os.path.join(good, "metrics.jsonl"), "w") as f:
        f.write(text)
    out = os.path.join(tmp, "loss.png")
    rc, msg = run(good, "--out", out)
    check("plots a run", rc == 0, f"rc {rc}: {msg}")
    png = open(out, "rb").read() if os.path.exists(out) else b""
    check("writes a PNG", png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000,
          f"{len(png)} bytes")
    rc, msg = run(good)
    check("default output RUN_DIR/loss.png", rc == 0 and os.path.exists(os.path.join(good, "loss.png")),
          f"rc {rc}: {msg}")

    rc, msg = run(os.path.join(tmp, "nothing-here"))
    check("missing metrics: exit 3 naming the file", rc == 3 and "metrics.jsonl" in msg,
          f"rc {rc}: {msg}")

    only_val = os.path.join(tmp, "only-val")
    os.makedirs(only_val)
    with open(os.path.join(only_val, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"event": "val", "step": 1, "val_loss": 3.0}) + "\n")
    rc, msg = run(only_val)
    check("no train records: exit 3", rc == 3, f"rc {rc}: {msg}")

    bad = os.path.join(tmp, "bad")
    os.makedirs(bad)
    with open(os.path.join(bad, "metrics.jsonl"), "w") as f:
        f.write(lines[0] + "\n{not json\n" + lines[1] + "\n")
    rc, msg = run(bad)
    check("malformed middle line: exit 3 naming line 2",
          rc == 3 and "metrics.jsonl:2: not valid JSON" in msg, f"rc {rc}: {msg}")

if failures:
    print(f"{failures} check(s) failed")
    sys.exit(1)
print("all plot_metrics.py checks passed")

#!/usr/bin/env python3
"""Plot a spotune run's training and validation loss against the step.

    pip install -r scripts/requirements-plot.txt    # matplotlib
    python3 scripts/plot_metrics.py runs/demo [--out loss.png]

Reads RUN_DIR/metrics.jsonl, one JSON object a line:
  {"event": "train", "step": ..., "loss": ..., "lr": ..., "grad_norm": ...,
   "tokens_per_s": ..., "elapsed_s": ...}
  {"event": "val", "step": ..., "val_loss": ...}
Other events and unknown fields are ignored; so is a torn last line (a run
that is still writing, or was killed mid-line). A step logged twice (the run
was resumed from an earlier checkpoint) is drawn with its later value. Writes a PNG, by default
RUN_DIR/loss.png.

Exit codes: 0 done; 2 usage error or matplotlib missing; 3 no usable metrics
(file missing, no train lines, a malformed line other than the last).
"""

import argparse
import json
import math
import os
import sys


class BadInput(Exception):
    pass


def read_metrics(path):
    """Returns (train, val): lists of (step, loss) sorted by step.

    A step logged twice (a run resumed from a checkpoint before it) keeps the
    later value.
    """
    if not os.path.isfile(path):
        raise BadInput(f"{path}: no such file (is RUN_DIR a spotune run directory?)")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    train, val = {}, {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            if lineno == len(lines):  # an unterminated last line: still being written
                continue
            raise BadInput(f"{path}:{lineno}: not valid JSON: {e}") from e
        if not isinstance(rec, dict):
            continue
        event = rec.get("event")
        try:
            if event == "train":
                train[int(rec["step"])] = float(rec["loss"])
            elif event == "val":
                val[int(rec["step"])] = float(rec["val_loss"])
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"{path}:{lineno}: {event} line without a numeric {e}") from e
    if not train:
        raise BadInput(f"{path}: no lines with \"event\": \"train\"")
    return sorted(train.items()), sorted(val.items())


def plot(train, val, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    steps, losses = zip(*train)
    ax.plot(steps, losses, label="train loss", color="tab:blue", linewidth=1.2)
    if val:
        vsteps, vlosses = zip(*val)
        ax.plot(vsteps, vlosses, label="val loss", color="tab:orange", marker="o", markersize=4,
                linewidth=1.2)
    finite = [v for _, v in train + val if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Plot train and val loss against step from RUN_DIR/metrics.jsonl.",
        epilog="Needs: pip install -r scripts/requirements-plot.txt")
    ap.add_argument("run_dir", metavar="RUN_DIR", help="a spotune run directory holding metrics.jsonl")
    ap.add_argument("--out", metavar="PNG", help="output image (default: RUN_DIR/loss.png)")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: matplotlib is missing. Install it with:\n"
              "  pip install -r scripts/requirements-plot.txt", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run_dir, "loss.png")
    try:
        train, val = read_metrics(os.path.join(args.run_dir, "metrics.jsonl"))
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    plot(train, val, out, title=os.path.basename(os.path.normpath(args.run_dir)))
    print(f"{out}: {len(train)} train points (last loss {train[-1][1]:.4f} at step {train[-1][0]}), "
          f"{len(val)} val points")
    return 0


if __name__ == "__main__":
    sys.exit(main())

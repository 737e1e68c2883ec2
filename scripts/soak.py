#!/usr/bin/env python3
"""soak.py — a long randomized campaign of interrupted training runs.

Trains the tiny model (LoRA, full fine-tuning, and one variant of each that
takes the other paths: QDoRA on whole documents with recomputation, and a
full fine-tune whose state is gathered rather than sharded; checkpoints local
only or also pushed to a local S3 server) under mpirun, interrupts each run at random
moments in random ways, restarts it (often on another number of ranks, and
for S3 runs sometimes on a "fresh machine" whose run directory is gone) until
it completes, and checks every promise of the checkpoint protocol:

  * every local checkpoint verifies (`spotune ckpt verify`) after every
    interruption, and so does every checkpoint in the bucket;
  * no .tmp- leftover of an interrupted write survives the next start;
  * every restart resumes from the newest checkpoint that was available
    before it started, local or in the bucket ("bad resume choice" otherwise),
    at sample step x 12, with the global batch of 12 windows kept;
  * a graceful stop (exit 75) committed its checkpoint, and pushed it when
    it says so; the final checkpoint of an S3 run is in the bucket;
  * exactly-once data (log.samples): each attempt's RUN_DIR/samples is moved
    to an archive outside the run directory; for each step the rows of the
    last attempt that trained it are taken, and the (step, sample, epoch,
    window) rows must equal the uninterrupted reference run's exactly;
  * metrics.jsonl of the finished run has every step once;
  * the result equals an uninterrupted run's: every step's loss
    (metrics.jsonl) and every tensor of the final adapter (LoRA) or model
    (full) within TOLERANCE below of the nearest of the uninterrupted
    references on 1, 2, 3 and 4 ranks, and bit-identical to the reference on
    the same rank count when every attempt whose steps make the result ran on
    that one rank count.

Tolerance: relative 1e-5 (|a - b| / |b| for a loss; max |a - b| / max |b|
for a tensor, as tests/test_rank_change.c). Not bitwise across rank counts
because the rank count changes the order in which the windows' gradients are
summed (a rank sums its own micro-batches, then the ranks' sums are
all-reduced); float32 addition is not associative, so each step's update
differs in the last bits, and the optimizer carries that forward. On one rank
count the continuation after a resume is the same arithmetic as without one,
so it must be bit-identical. The campaign first runs the uninterrupted
reference on each rank count 1..4 and reports their largest difference (the
noise floor of changing the rank count); it fails ("reference runs disagree")
if that floor is above half the tolerance, where 1e-5 could not tell a resume
defect from rounding. The learning rates below keep it near 2e-6: with Adam,
an element whose first gradients nearly cancel takes an update whose size
depends on their rounding, so a high learning rate (or an unlucky seed) lets
the floor reach 1e-4 without any resume. A resume defect (a wrong data
position, optimizer state or schedule step) moves the result by 1e-3 or more.

Exit status: 0 when every check passed, 1 otherwise (each failure is listed
after the summary, and the work directory is kept).

Interruption kinds (each counted in the summary):
  term-mpirun   SIGTERM to mpirun (it exits 1 and kills the ranks after its
                1 s grace, which can cut a checkpoint short)
  usr1-mpirun   SIGUSR1 to mpirun, forwarded to the ranks: checkpoint, exit 75
  term-rank     SIGTERM to one rank: all ranks stop at the step boundary, 75
  kill-rank     SIGKILL to one rank
  kill-mpirun   SIGKILL to mpirun; its orphaned ranks are waited for (then
                killed) before the restart
  write         a signal (one of the above, at random) while a checkpoint is
                being written: after its {"event":"checkpoint"} record and
                before its checkpoint_committed record in metrics.jsonl
  upload        (S3) the same while a committed checkpoint is being uploaded
  second        SIGUSR1 to mpirun, then a second stop signal while its
                checkpoint is being saved
and, after an interruption of an S3 run, at random: the run directory is
deleted before the restart (a fresh machine that must resume from the bucket).
The basic kinds are sometimes sent during start-up (before the first step).

Not part of CI. Python 3 standard library only.

With --launcher launch every run goes through scripts/launch.sh, as users
start it: the SIGTERM and SIGUSR1 kinds are sent to launch.sh (which turns
SIGTERM into a graceful stop: exit 75) and SIGKILL to its mpirun; the ranks
of a stop then exit 0 and launch.sh exits 75 from rank 0's status file.

usage: scripts/soak.py [--interruptions N] [--episodes N] [--seed S] [--keep]
                       [--quick] [--modes M,...] [--spotune PATH] [--work DIR]
                       [--launcher mpirun|launch]
"""
import argparse
import array
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-5          # relative, see the docstring
GLOBAL_BATCH = 12         # windows per step; 1, 2, 3 and 4 ranks all divide it
RANK_CHOICES = (1, 2, 3, 4)
CKPT_EVERY = 3
RUN_SEED = 7
BUCKET = "soak"
HANG_S = 300              # an attempt that has not ended this long after its signal hangs
FINAL_S = 900             # an uninterrupted run that takes longer hangs
ORPHAN_WAIT_S = 30        # ranks that outlive mpirun are killed after this long

# The math of each mode's runs (fixed: the reference runs calibrate it).
MODES = {
    "lora": dict(steps=36, sets={"train.mode": "lora", "train.lr": "2e-3",
                                 "train.min_lr": "2e-4", "lora.dropout": "0.1"},
                 output="adapter/adapter_model.safetensors"),
    "full": dict(steps=30, sets={"train.mode": "full", "train.lr": "5e-4",
                                 "train.min_lr": "5e-5"},
                 output="model/model.safetensors"),
    # the other paths through the checkpoint and the step: QDoRA (an NF4 base,
    # magnitude vectors) on whole documents with the layer recomputed; a full
    # fine-tune whose state rank 0 gathers (no shards), the gradient whole,
    # the micro-batches replayed from a recorded op list
    "qdora": dict(steps=36, sets={"train.mode": "lora", "train.lr": "1e-3",
                                  "train.min_lr": "1e-4", "lora.dropout": "0.1",
                                  "model.quantize": "nf4", "lora.dora": "true",
                                  "data.packing": "documents", "runtime.recompute": "layer"},
                  output="adapter/adapter_model.safetensors"),
    "full-gathered": dict(steps=30, sets={"train.mode": "full", "train.lr": "5e-4",
                                          "train.min_lr": "5e-5",
                                          "checkpoint.layout": "gathered",
                                          "train.shard_gradients": "false",
                                          "runtime.cuda_graphs": "true"},
                          output="model/model.safetensors"),
}

BASIC_KINDS = ("term-mpirun", "usr1-mpirun", "term-rank", "kill-rank", "kill-mpirun")
KIND_TITLES = {
    "term-mpirun": "SIGTERM to mpirun",
    "usr1-mpirun": "SIGUSR1 to mpirun (forwarded)",
    "term-rank": "SIGTERM to one rank",
    "kill-rank": "SIGKILL to one rank",
    "kill-mpirun": "SIGKILL to mpirun",
    "write": "a signal during a checkpoint write",
    "upload": "a signal during an S3 upload",
    "second": "a second signal during the stop's save",
}
SECOND_SIGNALS = ("usr1-mpirun", "term-rank", "int-rank")
GRACEFUL = ("usr1-mpirun", "term-rank", "int-rank")

FAILURE_CLASSES = [
    ("unverifiable", "unverifiable checkpoint"),
    ("resume", "bad resume choice"),
    ("samples", "lost or repeated sample"),
    ("tolerance", "output beyond tolerance"),
    ("metrics", "metrics.jsonl with a repeated or missing step"),
    ("tmp", ".tmp- leftover survived a start"),
    ("stop", "stop checkpoint not committed or pushed"),
    ("exit", "unexpected exit, hang or failed run"),
    ("calibration", "reference runs disagree"),
]


def now():
    return time.time()


def log(msg):
    print(msg, flush=True)


# ---- processes ------------------------------------------------------------------------


def proc_stat(pid):
    """(comm, state, ppid, starttime) of a process, or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            s = f.read()
    except OSError:
        return None
    l, r = s.find("("), s.rfind(")")
    rest = s[r + 2:].split()
    return s[l + 1:r], rest[0], int(rest[1]), int(rest[19])


def alive(pid, start=None):
    st = proc_stat(pid)
    if not st or st[1] in ("Z", "X"):
        return False
    return start is None or st[3] == start


def children(pid, comm=None):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = proc_stat(int(d))
        if st and st[2] == pid and (comm is None or st[0] == comm) and st[1] not in ("Z", "X"):
            out.append((int(d), st[3]))
    return out


def catches_stops(pid):
    """Whether the process has handlers for SIGTERM, SIGINT and SIGUSR1."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    m = int(line.split()[1], 16)
                    return all(m >> (s - 1) & 1 for s in (signal.SIGTERM, signal.SIGINT,
                                                           signal.SIGUSR1))
    except OSError:
        pass
    return False


def rank_number(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                    return int(kv.split(b"=", 1)[1])
    except (OSError, ValueError):
        pass
    return -1


def send(pid, start, sig):
    """Signals one of our processes if it is still the one we started."""
    if not alive(pid, start):
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


# ---- files ----------------------------------------------------------------------------


class Metrics:
    """Incremental reader of RUN_DIR/metrics.jsonl: the records of one attempt
    (time >= its start), surviving the rewrite a resume does."""

    def __init__(self, path, t0):
        self.path, self.t0 = path, t0
        self.reset()

    def reset(self):
        self.ino, self.off, self.part = None, 0, b""
        self.train, self.ckpt, self.committed, self.uploaded = [], [], set(), set()
        self.signal_ckpt = None

    def poll(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return self
        if st.st_ino != self.ino or st.st_size < self.off:
            self.reset()
            self.ino = st.st_ino
        if st.st_size == self.off:
            return self
        try:
            with open(self.path, "rb") as f:
                f.seek(self.off)
                data = f.read()
        except OSError:
            return self
        self.off += len(data)
        data = self.part + data
        lines = data.split(b"\n")
        self.part = lines.pop()
        for line in lines:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("time", 0) < self.t0:
                continue
            ev = r.get("event")
            if ev == "train":
                self.train.append(r["step"])
            elif ev == "checkpoint":
                self.ckpt.append(r["step"])
                if r.get("reason") == "signal":
                    self.signal_ckpt = r["step"]
            elif ev == "checkpoint_committed":
                m = re.match(r"step (\d+) ", r.get("message", ""))
                if m:
                    self.committed.add(int(m.group(1)))
            elif ev == "checkpoint_uploaded":
                m = re.search(r"step-(\d+)$", r.get("message", ""))
                if m:
                    self.uploaded.add(int(m.group(1)))
        return self


def read_train_losses(run_dir, bad=None):
    """(step, loss) of every train record; lines that are not JSON go to `bad`."""
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl"), errors="replace") as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                if bad is not None:
                    bad.append(line.strip()[:120])
                continue
            if r.get("event") == "train":
                out.append((r["step"], r["loss"]))
    return out


def read_safetensors(path):
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n])
    data = b[8 + n:]
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        if v["dtype"] != "F32":
            raise ValueError("%s: %s is %s, not F32" % (path, k, v["dtype"]))
        a = array.array("f")
        a.frombytes(data[v["data_offsets"][0]:v["data_offsets"][1]])
        if sys.byteorder != "little":
            a.byteswap()
        out[k] = a
    return out


def tensor_deviation(a_path, b_path):
    """max over tensors of max|a - b| / max|b|; (deviation, worst tensor, problem)."""
    ta, tb = read_safetensors(a_path), read_safetensors(b_path)
    if sorted(ta) != sorted(tb):
        return math.inf, "", "the tensors' names differ"
    worst, name = 0.0, ""
    for k, y in tb.items():
        x = ta[k]
        if len(x) != len(y):
            return math.inf, k, "%s has another size" % k
        m = max(map(abs, y)) if len(y) else 0.0
        e = max(map(lambda p: abs(p[0] - p[1]), zip(x, y))) if len(y) else 0.0
        d = e / m if m > 0 else e
        if d > worst:
            worst, name = d, k
    return worst, name, ""


def read_samples(d, bad=None):
    """Rows (step, sample, epoch, window) of every rank-R.tsv in d; incomplete
    lines go to `bad`."""
    rows = []
    if not os.path.isdir(d):
        return rows
    for name in sorted(os.listdir(d)):
        if not name.endswith(".tsv"):
            continue
        with open(os.path.join(d, name)) as f:
            for line in f:
                p = line.split()
                if line.endswith("\n") and len(p) == 4:
                    rows.append(tuple(int(v) for v in p))
                elif bad is not None:
                    bad.append("%s: %r" % (name, line))
    return rows


def tmp_leftovers(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    try:
        return sorted(n for n in os.listdir(d) if n.startswith(".tmp-"))
    except OSError:
        return []


def local_checkpoints(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    try:
        names = os.listdir(d)
    except OSError:
        return []
    return sorted((int(n[5:]), os.path.join(d, n)) for n in names
                  if re.fullmatch(r"step-\d{8}", n))


# ---- the campaign ---------------------------------------------------------------------


class Soak:
    def __init__(self, args):
        self.a = args
        self.modes = args.modes
        self.rng = random.Random(args.seed)
        self.spotune = os.path.abspath(args.spotune)
        self.work = args.work
        self.inputs = os.path.join(self.work, "inputs")
        self.endpoint = None
        self.swift_env = None
        self.env = dict(os.environ)
        if os.geteuid() == 0:
            self.env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        self.env.update(AWS_ACCESS_KEY_ID="test:tester",
                        AWS_SECRET_ACCESS_KEY="spotune-local-test-secret-7f3a",
                        AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        for k in ("AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            self.env.pop(k, None)
        self.via_launch = args.launcher == "launch"
        if self.via_launch:
            # what the mpirun command line below sets, and mpirun's own grace
            # after SIGTERM (launch.sh's default, 120 s, would make the
            # kill-mpirun and second-signal kinds wait minutes)
            self.env.update(OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_pml="ob1",
                            SPOTUNE_SIGKILL_TIMEOUT="1")
        self.failures = []
        self.kinds = Counter()
        self.kind_rc = defaultdict(Counter)
        self.in_window = Counter()
        self.cut_short = Counter()
        self.startup = Counter()
        self.sub = defaultdict(Counter)
        self.rcs = Counter()
        self.fresh_machines = 0
        self.verified_local = 0
        self.verified_remote = 0
        self.resumes = Counter()
        self.tmp_left = 0
        self.tmp_cleared = 0
        self.tmp_deleted = 0
        self.tmp_later = 0
        self.tmp_survivors = set()
        self.orphans_killed = 0
        self.orphans_waited = 0
        self.launcher_deaths = Counter()
        self.compared = []
        self.rows_checked = 0
        self.rank_changes = 0
        self.attempts = 0
        self.refs = {}
        self.floor = 0.0
        self.spread = {}
        self.current, self.current_ranks = None, []

    # -- failures
    def fail(self, cls, where, msg):
        self.failures.append((cls, where, msg))
        log("  FAILED (%s) %s: %s" % (dict(FAILURE_CLASSES)[cls], where, msg))

    def run_tool(self, *argv, timeout=120):
        try:
            p = subprocess.run([self.spotune, *argv], env=self.env, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, "spotune %s: no answer in %d s" % (" ".join(argv), timeout)
        return p.returncode, p.stdout + p.stderr

    # -- set-up
    def make_inputs(self):
        os.makedirs(self.inputs, exist_ok=True)
        text = os.path.join(self.inputs, "text.txt")
        subprocess.run(["bash", os.path.join(REPO, "scripts/make_demo_text.sh"), text, "3"],
                       check=True)
        subprocess.run([self.spotune, "prepare-text", text, os.path.join(self.inputs, "data"),
                        "--val-fraction", "0"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([self.spotune, "init-model", "--preset", "tiny", "--seed", "5",
                        os.path.join(self.inputs, "model")], check=True,
                       stdout=subprocess.DEVNULL)
        cfg = """run:
  dir: unused
  seed: {seed}
  lock_wait_s: 30
model:
  path: {inputs}/model
train:
  mode: lora
  steps: 10
  seq_len: 32
  micro_batch: 1
  grad_accum: 12
  lr: 1e-3
  schedule: cosine
  warmup_steps: 4
  min_lr: 1e-4
  clip_grad_norm: 1.0
lora:
  r: 4
  alpha: 8
  dropout: 0.1
  targets: [q_proj, v_proj, down_proj]
data:
  train: {inputs}/data.train.h5
log:
  every: 1
  samples: true
runtime:
  backend: cpu
  threads: 1
checkpoint:
  every_steps: {every}
  every_minutes: 0
  keep: 3
""".format(seed=RUN_SEED, inputs=self.inputs, every=CKPT_EVERY)
        with open(os.path.join(self.inputs, "run.yaml"), "w") as f:
            f.write(cfg)

    def start_store(self):
        base = os.path.join(self.work, "swift")
        cands = [(self.a.s3_port, self.a.s3_backend_port)] if self.a.s3_port else \
            [(28380 + 100 * i, 26310 + 100 * i) for i in range(8)]
        for port, bp in cands:
            if any(port_busy(p) for p in (port, bp, bp + 1, bp + 2)):
                continue
            env = dict(self.env, SWIFT_S3_BASE=base, SWIFT_S3_PORT=str(port),
                       SWIFT_S3_BACKEND_PORT=str(bp), SWIFT_S3_TIMEOUT="60")
            self.swift_env = env
            p = subprocess.run(["bash", os.path.join(REPO, "scripts/swift-s3.sh"), "start",
                                "--clean"], env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit("soak: the S3 server did not start:\n" + p.stdout + p.stderr)
            self.endpoint = "http://127.0.0.1:%d" % port
            tool = os.path.join(os.path.dirname(self.spotune), "checkpoint", "spotune-store-tool")
            if os.access(tool, os.X_OK):
                subprocess.run([tool, "--endpoint", self.endpoint, "mb", "s3://" + BUCKET],
                               env=self.env, check=True, stdout=subprocess.DEVNULL)
            else:  # no store tool: create the bucket with a signed PUT through curl
                subprocess.run(["curl", "-sf", "-X", "PUT", "--aws-sigv4",
                                "aws:amz:us-east-1:s3", "-H",
                                "x-amz-content-sha256:UNSIGNED-PAYLOAD", "--netrc-file",
                                os.path.join(base, "etc", "netrc"),
                                "%s/%s" % (self.endpoint, BUCKET)], check=True)
            log("soak: S3 server (OpenStack Swift + s3api) on %s, state in %s"
                % (self.endpoint, base))
            return
        raise SystemExit("soak: no free ports for the S3 server (tried %s)" % cands)

    def stop_store(self):
        if self.swift_env:
            subprocess.run(["bash", os.path.join(REPO, "scripts/swift-s3.sh"), "stop"],
                           env=self.swift_env, capture_output=True)
            self.swift_env = None

    # -- the store
    def remote_steps(self, prefix):
        """Steps with a MANIFEST in s3://BUCKET/prefix (retried: Swift can be slow)."""
        out = ""
        for _ in range(5):
            rc, out = self.run_tool("ckpt", "list", "s3://%s/%s" % (BUCKET, prefix),
                                    "--endpoint", self.endpoint)
            if rc == 0:
                return sorted(int(m.group(1)) for m in
                              re.finditer(r"^step-\d+\s+(\d+)\s.*\scomplete \(", out, re.M))
            time.sleep(1)
        raise RuntimeError("cannot list s3://%s/%s: %s" % (BUCKET, prefix, out.strip()))

    def verify_remote(self, where, prefix, step):
        url = "s3://%s/%s/step-%08d" % (BUCKET, prefix, step)
        rc, out = self.run_tool("ckpt", "verify", url, "--endpoint", self.endpoint)
        if rc == 0:
            self.verified_remote += 1
            return True
        # a step pruned by retention in between is not a damaged checkpoint
        if step not in self.remote_steps(prefix):
            return True
        self.fail("unverifiable", where, "%s: %s" % (url, out.strip()))
        return False

    def verify_local(self, where, run_dir):
        for step, path in local_checkpoints(run_dir):
            rc, out = self.run_tool("ckpt", "verify", path)
            if rc == 0:
                self.verified_local += 1
            elif os.path.isdir(path):
                self.fail("unverifiable", where, "%s: %s" % (path, out.strip()))

    # -- one run of spotune under mpirun
    def command(self, ranks, run_dir, mode, steps, ga, prefix):
        if self.via_launch:  # (it passes AWS_* on by name)
            cmd = [os.path.join(REPO, "scripts", "launch.sh"), "-g", str(ranks), "--tcp", "--"]
        else:
            cmd = ["mpirun", "--oversubscribe", "--mca", "pml", "ob1", "--mca", "btl",
                   "tcp,self", "-np", str(ranks)]
            if prefix:
                cmd += ["-x", "AWS_ACCESS_KEY_ID", "-x", "AWS_SECRET_ACCESS_KEY", "-x",
                        "AWS_REGION"]
        cmd += [self.spotune, "train", os.path.join(self.inputs, "run.yaml"),
                "--set", "run.dir=" + run_dir, "--set", "train.steps=%d" % steps,
                "--set", "train.grad_accum=%d" % ga]
        for k, v in MODES[mode]["sets"].items():
            cmd += ["--set", "%s=%s" % (k, v)]
        if prefix:
            cmd += ["--set", "checkpoint.remote=s3://%s/%s" % (BUCKET, prefix),
                    "--set", "checkpoint.endpoint=" + self.endpoint]
        return cmd

    def launch(self, cmd, log_path):
        f = open(log_path, "w")
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                             start_new_session=True, cwd=self.work)
        f.close()
        self.current, self.current_ranks = p, []
        return p

    def mpirun_of(self, p):
        """The mpirun of an attempt: p itself, or launch.sh's child."""
        if not self.via_launch:
            return p.pid
        kids = children(p.pid, "mpirun")
        return kids[0][0] if kids else None

    def ranks_of(self, p):
        """The rank processes of an attempt (mpirun's spotune children)."""
        m = self.mpirun_of(p)
        return children(m, "spotune") if m else []

    def abandon(self):
        """The soak itself is stopped: end the attempt it started, if any."""
        p = getattr(self, "current", None)
        if p is not None:
            self.kill_all(p, self.current_ranks + self.ranks_of(p))

    def wait_exit(self, p, timeout):
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return 128 - rc if rc < 0 else rc

    def reap(self, where, p, ranks_seen):
        """After mpirun ended (or was killed): every rank it started must be gone
        before anything else touches the run directory."""
        left = [(pid, st) for pid, st in ranks_seen if alive(pid, st)]
        if left:
            self.orphans_waited += 1
        t = now()
        while left and now() - t < ORPHAN_WAIT_S:
            time.sleep(0.1)
            left = [(pid, st) for pid, st in left if alive(pid, st)]
        for pid, st in left:
            send(pid, st, signal.SIGKILL)
            self.orphans_killed += 1
        t = now()
        while any(alive(pid, st) for pid, st in left) and now() - t < 30:
            time.sleep(0.1)
        if left:
            log("  %s: %d rank(s) outlived mpirun by %d s; killed" % (where, len(left),
                                                                       ORPHAN_WAIT_S))

    def kill_all(self, p, ranks_seen):
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for pid, st in ranks_seen:
            send(pid, st, signal.SIGKILL)

    # -- the references
    def references(self):
        log("soak: uninterrupted reference runs, each mode on 1, 2, 3 and 4 ranks")
        for mode in self.modes:
            steps = MODES[mode]["steps"]
            for r in RANK_CHOICES:
                d = os.path.join(self.work, "ref", "%s-%d" % (mode, r))
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(os.path.dirname(d), exist_ok=True)
                t = now()
                p = self.launch(self.command(r, d, mode, steps, GLOBAL_BATCH // r, None),
                                d + ".log")
                rc = self.wait_exit(p, FINAL_S)
                if rc != 0:
                    self.kill_all(p, self.ranks_of(p))
                    raise SystemExit("soak: the reference run %s ended %s; see %s.log"
                                     % (d, rc, d))
                bad = []
                rows = read_samples(os.path.join(d, "samples"), bad)
                if bad:
                    self.fail("calibration", d, "incomplete lines in the sample log: %s"
                              % ", ".join(bad[:3]))
                self.refs[(mode, r)] = dict(dir=d, rows=Counter(rows),
                                            losses=read_train_losses(d))
                log("  %s on %d rank(s): %d steps in %.1f s" % (mode, r, steps, now() - t))
            # the data order does not depend on the rank count, and each reference
            # trains every sample once, in its own step
            base = self.refs[(mode, 1)]
            for r in RANK_CHOICES:
                ref = self.refs[(mode, r)]
                rows = ref["rows"]
                if rows != base["rows"]:
                    self.fail("calibration", "reference %s-%d" % (mode, r),
                              "its samples differ from the 1-rank reference's")
                samples = Counter(s for (_, s, _, _) in rows.elements())
                bad = [x for x in rows if not ((x[0] - 1) * GLOBAL_BATCH <= x[1]
                                               < x[0] * GLOBAL_BATCH)]
                if (sorted(samples) != list(range(steps * GLOBAL_BATCH))
                        or max(samples.values()) != 1 or bad):
                    self.fail("calibration", "reference %s-%d" % (mode, r),
                              "does not train samples 0..%d once each in their steps"
                              % (steps * GLOBAL_BATCH - 1))
                if [s for s, _ in ref["losses"]] != list(range(1, steps + 1)):
                    self.fail("calibration", "reference %s-%d" % (mode, r),
                              "metrics.jsonl does not have steps 1..%d once each" % steps)
            spread = 0.0
            for i, r in enumerate(RANK_CHOICES):
                for q in RANK_CHOICES[i + 1:]:
                    dl, dt = self.deviation(self.refs[(mode, r)]["dir"],
                                            self.refs[(mode, q)]["dir"], mode)
                    spread = max(spread, dl, dt)
            self.spread[mode] = spread
            self.floor = max(self.floor, spread)
            log("  %s: the references differ by up to %.2e (relative) between rank counts"
                % (mode, spread))
        log("soak: the references' spread across rank counts (noise floor): %.2e "
            "(tolerance %.0e)" % (self.floor, TOLERANCE))
        if self.floor > TOLERANCE / 2:
            self.fail("calibration", "references",
                      "their spread %.2e is above half the tolerance: 1e-5 cannot tell a "
                      "resume defect from the rank count's rounding here" % self.floor)

    def deviation(self, run_dir, ref_dir, mode):
        """(loss deviation, tensor deviation) of run_dir against ref_dir."""
        la, lb = dict(read_train_losses(run_dir)), dict(read_train_losses(ref_dir))
        dl = max((abs(la[s] - lb[s]) / abs(lb[s]) if s in la else math.inf) for s in lb)
        out = MODES[mode]["output"]
        dt, _, _ = tensor_deviation(os.path.join(run_dir, out), os.path.join(ref_dir, out))
        return dl, dt

    # -- one episode: a run interrupted `quota` times, restarted until it completes
    def episode(self, n, mode, s3, quota, fixed_ranks):
        steps = MODES[mode]["steps"]
        name = "ep%02d-%s-%s" % (n, mode, "s3" if s3 else "local")
        root = os.path.join(self.work, name)
        run_dir = os.path.join(root, "run")
        archive = os.path.join(root, "archive")
        os.makedirs(archive)
        prefix = name if s3 else None
        ranks = self.rng.choice(RANK_CHOICES)
        first_ranks = ranks
        log("soak: episode %d: %s, %s, %d steps, %d interruption(s), %s"
            % (n, mode, "checkpoints pushed to S3" if s3 else "local checkpoints", steps,
               quota, "on %d rank(s) throughout" % ranks if fixed_ranks
               else "rank count redrawn at restarts"))
        attempts = []
        done = False
        interrupted = 0
        fresh = False
        prev_tmp = []
        seen_tmp = set()
        ep_fail0 = len(self.failures)
        for k in range(quota + 20):
            where = "%s attempt %d" % (name, k + 1)
            if k > 0 and not fixed_ranks and self.rng.random() < 0.7:
                new = self.rng.choice(RANK_CHOICES)
                if new != ranks:
                    self.rank_changes += 1
                ranks = new
            # what this start may resume from
            local = [s for s, _ in local_checkpoints(run_dir)]
            remote = []
            if s3:
                try:
                    remote = self.remote_steps(prefix)
                except RuntimeError as e:
                    self.fail("exit", where, str(e))
            avail = max(local + remote) if local + remote else None
            # a fresh start takes grad_accum literally; a resume re-splits the batch
            ga = GLOBAL_BATCH // (ranks if avail is None else first_ranks)
            if avail is None:
                first_ranks = ranks
            att = dict(n=k + 1, ranks=ranks, avail=avail, local=local, remote=remote,
                       fresh=fresh, kind=None)
            kind = None
            if interrupted < quota:
                kinds = list(BASIC_KINDS) + ["write", "second"] + (["upload"] if s3 else [])
                kind = self.rng.choice(kinds)
            log_path = os.path.join(archive, "attempt-%02d.log" % (k + 1))
            t0 = now()
            p = self.launch(self.command(ranks, run_dir, mode, steps, ga, prefix), log_path)
            self.attempts += 1
            used = self.interrupt(p, kind, att, os.path.join(run_dir, "metrics.jsonl"), t0,
                                  ranks, steps, quota - interrupted, where)
            rc = self.wait_exit(p, HANG_S if att["kind"] else FINAL_S)
            # mpirun itself ended by a signal (not an exit status it chose)
            att["mpirun_signal"] = -p.returncode if p.returncode and p.returncode < 0 else None
            if rc is None:
                self.fail("exit", where, "did not end within %d s (kind %s); killed"
                          % (HANG_S if att["kind"] else FINAL_S, att["kind"]))
                self.kill_all(p, used)
                rc = self.wait_exit(p, 60)
            self.reap(where, p, used)
            att["rc"] = rc
            self.rcs[rc] += 1
            text = open(log_path, errors="replace").read()
            kind = att["kind"]
            if kind:
                interrupted += 1
                self.kinds[kind] += 1
                self.kind_rc[kind][rc] += 1
            self.check_attempt(where, att, text, rc, run_dir, prev_tmp, prefix, steps)
            # samples of this attempt, outside the run directory
            sd = os.path.join(run_dir, "samples")
            dest = os.path.join(archive, "samples-%02d" % (k + 1))
            if os.path.isdir(sd):
                shutil.move(sd, dest)
            bad = []
            att["rows"] = read_samples(dest, bad)
            if bad:
                self.fail("samples", where, "incomplete lines in the sample log: %s"
                          % ", ".join(bad[:3]))
            attempts.append(att)
            desc = "%-5s %d rank(s), %-22s exit %3s, %s" % (
                "start" if k == 0 else "again", ranks,
                (kind or "(to the end)") + ("/" + att["sub"] if att.get("sub") else "")
                + (" at start-up" if att.get("startup") else ""),
                rc, "resumed from step %d" % att["resumed"] if att.get("resumed") is not None
                else "no resume" if att.get("decided") else "stopped before the resume")
            log("  %s: %s" % (where, desc))
            if rc == 0:
                done = True
                break
            # after an interruption
            self.verify_local(where, run_dir)
            prev_tmp = tmp_leftovers(run_dir)
            self.tmp_left += len(set(prev_tmp) - seen_tmp)
            seen_tmp.update(prev_tmp)
            if s3:
                try:
                    rs = self.remote_steps(prefix)
                except RuntimeError as e:
                    self.fail("exit", where, str(e))
                    rs = []
                if rs:
                    self.verify_remote(where, prefix, rs[-1])
                self.check_stop_pushed(where, att, text, rs)
            fresh = s3 and self.rng.random() < 0.4
            if fresh:
                shutil.rmtree(run_dir)
                self.fresh_machines += 1
                self.tmp_deleted += sum(1 for t in prev_tmp if os.path.join(
                    run_dir, "checkpoints", t) not in self.tmp_survivors)
                prev_tmp = []
                log("  %s: run directory deleted (a fresh machine)" % where)
        if not done:
            self.fail("exit", name, "did not complete after %d attempts" % len(attempts))
            return interrupted
        self.check_episode(name, mode, steps, s3, prefix, run_dir, attempts)
        if len(self.failures) == ep_fail0 and not self.a.keep:
            shutil.rmtree(root, ignore_errors=True)
        return interrupted

    # -- the interruption of one attempt
    def interrupt(self, p, kind, att, metrics_path, t0, ranks, steps, left, where):
        """Sends the attempt's interruption; returns the rank processes seen."""
        seen = {}
        deadline = t0 + FINAL_S  # past it, the attempt is left to wait_exit (a hang)

        def running():
            return p.poll() is None and now() < deadline

        def refresh():
            for pid, st in self.ranks_of(p):
                seen[pid] = st
            return len(seen)

        # the ranks are up, with their stop handlers installed
        while running():
            if refresh() >= ranks and all(catches_stops(pid) for pid in seen):
                break
            time.sleep(0.01)
        self.current_ranks = list(seen.items())
        if kind is None or not running():
            return list(seen.items())
        pids = list(seen.items())
        m = Metrics(metrics_path, t0)

        def fire(sig_kind, writer_first=False):
            if sig_kind.endswith("-mpirun"):
                sig = {"term": signal.SIGTERM, "usr1": signal.SIGUSR1,
                       "kill": signal.SIGKILL}[sig_kind.split("-")[0]]
                # via launch.sh: SIGTERM and SIGUSR1 to it (as a supervisor or
                # docker stop send them), SIGKILL to its mpirun
                target = p.pid
                if self.via_launch and sig == signal.SIGKILL:
                    target = self.mpirun_of(p)
                if p.poll() is None and target:
                    try:
                        os.kill(target, sig)
                    except ProcessLookupError:
                        return False
                    return True
                return False
            sig = {"term": signal.SIGTERM, "int": signal.SIGINT,
                   "kill": signal.SIGKILL}[sig_kind.split("-")[0]]
            live = [(pid, st) for pid, st in pids if alive(pid, st)]
            if not live:
                return False
            pid, st = self.rng.choice(live)
            if writer_first and self.rng.random() < 0.6:
                # rank 0 writes and pushes the checkpoints: hit it more often
                pid, st = next(((q, t) for q, t in live if rank_number(q) == 0), (pid, st))
            att["victim_rank"] = rank_number(pid)
            return send(pid, st, sig)

        def wait_step(target):
            while running():
                m.poll()
                if m.train and m.train[-1] >= target:
                    return True
                time.sleep(0.01)
            return False

        def first_step():
            while running():
                m.poll()
                if m.train:
                    return m.train[0]
                time.sleep(0.01)
            return None

        # how far into the run: spread the remaining interruptions over the rest
        def target_from(s0):
            span = max(2, round(2 * max(steps - s0, 1) / (left + 1)))
            return min(s0 + self.rng.randint(0, span), steps - 1)

        if kind in BASIC_KINDS:
            if self.rng.random() < 0.12:
                att["startup"] = True
                self.startup[kind] += 1
                time.sleep(self.rng.uniform(0, 1.5))
            else:
                s0 = first_step()
                if s0 is None or not wait_step(target_from(s0)):
                    return pids
                time.sleep(self.rng.uniform(0, 0.2))
            if fire(kind):
                att["kind"] = kind
            return pids

        if kind in ("write", "upload"):
            sub = self.rng.choice(BASIC_KINDS)
            s0 = first_step()
            if s0 is None:
                return pids
            target = target_from(s0)
            while running():
                m.poll()
                if kind == "write":
                    open_ = [s for s in m.ckpt if s >= target and s not in m.committed]
                else:
                    open_ = [s for s in m.committed if s >= target and s not in m.uploaded]
                if open_:
                    if fire(sub, writer_first=True):
                        att.update(kind=kind, sub=sub, window_step=open_[-1])
                        self.in_window[kind] += 1
                        self.sub[kind][sub] += 1
                    return pids
                time.sleep(0.001)
            return pids

        if kind == "second":
            s0 = first_step()
            if s0 is None or not wait_step(target_from(s0)):
                return pids
            time.sleep(self.rng.uniform(0, 0.2))
            if not fire("usr1-mpirun"):
                return pids
            att["kind"] = kind
            sub = self.rng.choice(SECOND_SIGNALS)
            att["sub"] = sub
            self.sub[kind][sub] += 1
            while running():
                m.poll()
                s = m.signal_ckpt
                if s is not None:
                    in_save = s not in m.committed
                    if fire(sub) and in_save:
                        self.in_window[kind] += 1
                        att["window_step"] = s
                    return pids
                time.sleep(0.001)
            return pids
        raise ValueError(kind)

    # -- checks of one attempt
    def check_attempt(self, where, att, text, rc, run_dir, prev_tmp, prefix, steps):
        """Resume choice, global batch, exit code and .tmp- cleanup of one attempt."""
        m = re.search(r"resumed from (\S+): step (\d+), sample (\d+)", text)
        decided = "\nmodel: " in "\n" + text or m is not None
        att["decided"] = decided
        att["resumed"] = int(m.group(2)) if m else None
        if decided:
            self.resumes["checked"] += 1
            if att["avail"] is None:
                self.resumes["fresh starts (nothing available)"] += 1
                if m:
                    self.fail("resume", where, "resumed from step %s with no checkpoint "
                              "available" % m.group(2))
            else:
                got = int(m.group(2)) if m else None
                if att["avail"] not in att["local"]:
                    self.resumes["from the bucket (newer than local)"] += 1
                else:
                    self.resumes["from a local checkpoint"] += 1
                if att["fresh"]:
                    self.resumes["on a fresh machine"] += 1
                if got != att["avail"]:
                    why = ""
                    if "cannot list" in text:
                        why = " (the log says the store could not be listed)"
                    self.fail("resume", where,
                              "resumed from %s, but step %d was available (local %s, bucket "
                              "%s)%s" % ("step %d" % got if got is not None else "nothing",
                                         att["avail"], att["local"], att["remote"], why))
                elif int(m.group(3)) != got * GLOBAL_BATCH:
                    self.fail("resume", where, "resumed at sample %s after %d steps of %d"
                              % (m.group(3), got, GLOBAL_BATCH))
            ga = GLOBAL_BATCH // att["ranks"]
            want = "global batch %d windows (%d rank%s x 1 x %d)" % (
                GLOBAL_BATCH, att["ranks"], "" if att["ranks"] == 1 else "s", ga)
            if "\ndata: " in text and want not in text:
                g = re.search(r"global batch .*?\)", text)
                self.fail("resume", where, "expected '%s', the log says '%s'"
                          % (want, g.group(0) if g else "nothing"))
            # leftovers of the previous attempts' interrupted writes are gone
            for n in prev_tmp:
                path = os.path.join(run_dir, "checkpoints", n)
                if not os.path.exists(path):
                    if path in self.tmp_survivors:
                        self.tmp_later += 1
                    else:
                        self.tmp_cleared += 1
                    continue
                if path in self.tmp_survivors:
                    continue  # reported when it first survived
                pid = int(n.rsplit("-", 1)[1])
                if alive(pid):
                    log("  %s: %s left alone: its pid %d is alive again (reused)"
                        % (where, n, pid))
                    continue
                st = proc_stat(pid)
                why = (" (its writer, pid %d, has exited but is not yet reaped: a zombie, "
                       "which the start took for a live writer)" % pid
                       if st and st[1] == "Z" else "")
                self.tmp_survivors.add(path)
                self.fail("tmp", where, "%s survived the start%s" % (n, why))
        # exit codes
        kind, sub = att["kind"], att.get("sub")
        sig = sub if kind in ("write", "upload") else kind
        # Open MPI 4.1's mpirun, signalled while it shuts down after the ranks
        # have ended (finished, or stopped on the signal with a checkpoint):
        # SIGTERM lands in a handler of an already unloaded component
        # (SIGSEGV, in orte_session_dir_cleanup), and SIGUSR1 finds its
        # handler removed and kills it. The ranks' work is complete and every
        # check below and of the later attempts still applies; the launcher's
        # death is counted, not failed.
        to_mpirun = "mpirun" in (kind or "") + (sub or "") or kind == "second"
        ended = "\ndone: " in "\n" + text or "after committing checkpoint step" in text
        if (to_mpirun and ended and
                att.get("mpirun_signal") in (signal.SIGSEGV, signal.SIGUSR1)):
            self.launcher_deaths[signal.Signals(att["mpirun_signal"]).name] += 1
            log("  %s: mpirun died by %s in its shutdown, after the ranks had ended"
                % (where, signal.Signals(att["mpirun_signal"]).name))
        elif rc in (2, 3):
            self.fail("exit", where, "exit %d after %s:\n%s" % (rc, kind, tail(text)))
        elif kind is None and rc != 0:
            self.fail("exit", where, "exit %s without an interruption:\n%s" % (rc, tail(text)))
        elif (sig in GRACEFUL or kind == "second" or
              (self.via_launch and sig == "term-mpirun")) and rc not in (75, 0):
            self.fail("exit", where, "exit %s after %s%s (a graceful stop exits 75):\n%s"
                      % (rc, kind, "/" + sub if sub else "", tail(text)))
        elif sig == "term-mpirun" and rc not in (1, 0, 75):
            self.fail("exit", where, "exit %s after SIGTERM to mpirun:\n%s" % (rc, tail(text)))
        if rc == 75:
            ms = re.search(r"after committing checkpoint step (\d+)", text)
            if ms:
                s = int(ms.group(1))
                att["stop_step"] = s
                if s not in [x for x, _ in local_checkpoints(run_dir)]:
                    self.fail("stop", where, "exit 75 after committing step %d, which is not "
                              "in %s/checkpoints" % (s, run_dir))
            elif "before training started" not in text:
                self.fail("stop", where, "exit 75 without saying which checkpoint it committed")
        # the stop's checkpoint, or the kill, during a write: was it cut short?
        if att.get("window_step") is not None and kind in ("write", "second"):
            ws = att["window_step"]
            if any(n.startswith(".tmp-step-%08d-" % ws) for n in tmp_leftovers(run_dir)):
                self.cut_short[kind] += 1

    def check_stop_pushed(self, where, att, text, remote):
        s = att.get("stop_step")
        if s is None:
            return
        if re.search(r"checkpoint step %d is in s3://" % s, text) and s not in remote:
            # retention may have removed it only if newer ones are there
            if not remote or max(remote) < s:
                self.fail("stop", where, "the log says step %d is in the bucket; the bucket "
                          "has %s" % (s, remote))

    # -- checks at the end of an episode
    def check_episode(self, name, mode, steps, s3, prefix, run_dir, attempts):
        self.verify_local(name, run_dir)
        left = [t for t in tmp_leftovers(run_dir)
                if os.path.join(run_dir, "checkpoints", t) not in self.tmp_survivors]
        if left:
            self.fail("tmp", name, "leftovers after the end: %s" % left)
        if s3:
            rs = self.remote_steps(prefix)
            if not rs or rs[-1] != steps:
                self.fail("stop", name, "the final checkpoint step %d is not in the bucket "
                          "(it has %s)" % (steps, rs))
            for s in rs:
                self.verify_remote(name, prefix, s)
        # exactly-once: per step, the rows of the last attempt that trained it
        last = {}
        for a in attempts:
            by_step = defaultdict(list)
            for r in a["rows"]:
                by_step[r[0]].append(r)
            res = a.get("resumed") or 0
            early = [s for s in by_step if s <= res]
            if early:
                self.fail("samples", "%s attempt %d" % (name, a["n"]),
                          "trained step(s) %s, at or before its checkpoint step %d"
                          % (sorted(early), res))
            for s, rows in by_step.items():
                last[s] = (a, rows)
        # the attempts whose steps make the result, and their rank counts
        used_ranks = {a["ranks"] for a, _ in last.values()}
        first_ranks = last[1][0]["ranks"] if 1 in last else attempts[0]["ranks"]
        got = Counter(r for s in sorted(last) for r in last[s][1])
        ref = self.refs[(mode, 1)]
        lost = ref["rows"] - got
        extra = got - ref["rows"]
        self.rows_checked += sum(got.values())
        if lost or extra:
            self.fail("samples", name, "%d row(s) of the reference never trained (e.g. %s); "
                      "%d trained more than once or not in the reference (e.g. %s)"
                      % (sum(lost.values()), sorted(lost)[:3], sum(extra.values()),
                         sorted(extra)[:3]))
        # the result
        bad = []
        losses = read_train_losses(run_dir, bad)
        if bad:
            self.fail("metrics", name, "%d line(s) of metrics.jsonl are not JSON, e.g. %r"
                      % (len(bad), bad[0]))
        if [s for s, _ in losses] != list(range(1, steps + 1)):
            c = Counter(s for s, _ in losses)
            self.fail("metrics", name, "metrics.jsonl's train records are not steps 1..%d "
                      "once each (missing %s, repeated %s)"
                      % (steps, [s for s in range(1, steps + 1) if s not in c],
                         [s for s, v in c.items() if v > 1]))
        # one rank count throughout: the same arithmetic as that rank count's
        # uninterrupted run, bit for bit. Otherwise: within TOLERANCE of an
        # uninterrupted run (the nearest of the four references).
        bitwise = len(used_ranks) == 1
        out = MODES[mode]["output"]
        a_out = os.path.join(run_dir, out)
        if not os.path.exists(a_out):
            self.fail("tolerance", name, "no %s" % a_out)
            return
        la = dict(losses)
        best = None
        for r in sorted(used_ranks) if bitwise else RANK_CHOICES:
            ref = self.refs[(mode, r)]
            r_out = os.path.join(ref["dir"], out)
            lb = dict(ref["losses"])
            dl = max((abs(la[s] - lb[s]) / abs(lb[s]) if s in la else math.inf) for s in lb)
            dt, worst, problem = tensor_deviation(a_out, r_out)
            same = (open(a_out, "rb").read() == open(r_out, "rb").read()
                    and all(la.get(s) == v for s, v in lb.items()))
            cand = (max(dl, dt), r, dl, dt, worst, problem, same)
            if best is None or cand[:2] < best[:2]:
                best = cand
        _, ref_ranks, dl, dt, worst, problem, same = best
        self.compared.append(dict(name=name, bitwise=bitwise, dl=dl, dt=dt, identical=same))
        how = "bit-identical to" if same else "loss %.2e, tensors %.2e from" % (dl, dt)
        log("  %s: complete after %d attempt(s) on rank counts %s (step 1 on %d); %s the "
            "%d-rank reference" % (name, len(attempts), sorted(used_ranks), first_ranks, how,
                                   ref_ranks))
        if problem:
            self.fail("tolerance", name, problem)
        if bitwise and not same:
            self.fail("tolerance", name, "every attempt ran on %d rank(s), yet the result is "
                      "not bit-identical to the %d-rank reference (loss %.3g, %s %.3g)"
                      % (ref_ranks, ref_ranks, dl, worst, dt))
        if dl > TOLERANCE or dt > TOLERANCE:
            self.fail("tolerance", name, "loss deviation %.3g, tensor deviation %.3g (%s) "
                      "above %.0e from the nearest reference (%d ranks)"
                      % (dl, dt, worst, TOLERANCE, ref_ranks))

    # -- the whole campaign
    def run(self):
        t_start = now()
        os.makedirs(self.work, exist_ok=True)
        log("soak: seed %d, work dir %s, spotune %s" % (self.a.seed, self.work, self.spotune))
        if self.via_launch:
            log("soak: every run through scripts/launch.sh: the SIGTERM and SIGUSR1 kinds go to "
                "it (SIGTERM is a graceful stop there: exit 75), SIGKILL to its mpirun")
        self.make_inputs()
        self.start_store()
        self.references()
        combos = [(m, s) for m in self.modes for s in (False, True)]
        total, n = 0, 0
        order = []
        while True:
            if self.a.episodes is not None:
                if n >= self.a.episodes:
                    break
            elif total >= self.a.interruptions and n >= len(combos):
                break
            if not order:
                order = combos[:]
                self.rng.shuffle(order)
            mode, s3 = order.pop()
            if self.a.episodes is not None:
                quota = -(-self.a.interruptions // self.a.episodes)
            else:
                quota = min(self.rng.randint(*self.a.quota),
                            max(self.a.interruptions - total, self.a.quota[0]))
            fixed = self.rng.random() < 0.25
            n += 1
            total += self.episode(n, mode, s3, quota, fixed)
            if n > 10 * max(len(combos), self.a.interruptions):
                break
        self.elapsed = now() - t_start
        self.episodes = n
        return self.summary(total)

    def summary(self, total):
        lines = []
        w = lines.append
        mins, secs = divmod(int(self.elapsed), 60)
        w("soak summary: seed %d, %d episodes, %d attempts, %d interruptions, %d:%02d minutes"
          % (self.a.seed, self.episodes, self.attempts, total, mins, secs))
        w("")
        w("| interruption | count | of them in the window | signal sent | exit codes |")
        w("| --- | ---: | ---: | --- | --- |")
        for k in list(BASIC_KINDS) + ["write", "upload", "second"]:
            if not self.kinds[k] and k == "upload" and not self.endpoint:
                continue
            extra = ""
            if k in BASIC_KINDS:
                extra = "%d at start-up" % self.startup[k] if self.startup[k] else ""
            win = ""
            if k in ("write", "upload", "second"):
                win = str(self.in_window[k])
                if self.cut_short[k]:
                    win += " (%d left a .tmp-)" % self.cut_short[k]
            sub = ", ".join("%s %d" % (s, c) for s, c in sorted(self.sub[k].items()))
            codes = ", ".join("%s: %d" % (rc, c) for rc, c in sorted(self.kind_rc[k].items(),
                                                                     key=rc_order))
            w("| %s%s | %d | %s | %s | %s |" % (KIND_TITLES[k], " (%s)" % extra if extra else "",
                                                self.kinds[k], win or "", sub, codes))
        w("| **total** | **%d** | | | |" % total)
        w("| run directory deleted before the restart (S3) | %d | | | |" % self.fresh_machines)
        w("")
        w("| what | result |")
        w("| --- | --- |")
        w("| outcomes by exit code | %s |" % ", ".join(
            "%s: %d" % (rc, c) for rc, c in sorted(self.rcs.items(), key=rc_order)))
        w("| rank-count changes at restarts | %d |" % self.rank_changes)
        w("| checkpoints verified | %d local, %d in the bucket; %d unverifiable |"
          % (self.verified_local, self.verified_remote, self.count("unverifiable")))
        w("| resumes checked | %d (%s); %d bad choice(s) |" % (
            self.resumes["checked"], ", ".join("%s %d" % (k, v) for k, v in
                                               sorted(self.resumes.items()) if k != "checked"),
            self.count("resume")))
        w("| .tmp- leftovers of interrupted writes | %d left; %d removed by the next start, "
          "%d survived it (%d of them removed by a later one), %d went with a deleted run "
          "directory |" % (self.tmp_left, self.tmp_cleared, self.count("tmp"), self.tmp_later,
                           self.tmp_deleted))
        w("| ranks that outlived mpirun | %d launch(es) waited for, %d rank(s) killed after "
          "%d s |" % (self.orphans_waited, self.orphans_killed, ORPHAN_WAIT_S))
        w("| mpirun killed by the signal sent to it, in its shutdown after the ranks ended "
          "(Open MPI's) | %s |" % (", ".join("%s %d" % kv for kv in
                                           sorted(self.launcher_deaths.items())) or "none"))
        w("| exactly-once data | %d rows of %d episodes; %d episode(s) with a lost or "
          "repeated sample |" % (self.rows_checked, len(self.compared),
                                 len({f[1] for f in self.failures if f[0] == "samples"})))
        nb = sum(1 for c in self.compared if c["bitwise"])
        ni = sum(1 for c in self.compared if c["bitwise"] and c["identical"])
        cross = [c for c in self.compared if not c["bitwise"]]
        w("| runs compared with an uninterrupted run | %d: %d on one rank count (%d "
          "bit-identical), %d across rank counts |" % (len(self.compared), nb, ni, len(cross)))
        w("| max deviation (relative) | loss %.2e, tensors %.2e; tolerance %.0e; references' "
          "spread across rank counts %.2e |" % (
              max([c["dl"] for c in self.compared] or [0]),
              max([c["dt"] for c in self.compared] or [0]), TOLERANCE, self.floor))
        w("| failures | %s |" % (", ".join("%s %d" % (t, self.count(c)) for c, t in
                                         FAILURE_CLASSES if self.count(c)) or "none"))
        text = "\n".join(lines)
        log("")
        log(text)
        if self.failures:
            log("")
            log("FAILURES:")
            for cls, where, msg in self.failures:
                log("  [%s] %s: %s" % (dict(FAILURE_CLASSES)[cls], where, msg))
        with open(os.path.join(self.work, "summary.md"), "w") as f:
            f.write(text + "\n")
        return 1 if self.failures else 0

    def count(self, cls):
        return sum(1 for f in self.failures if f[0] == cls)


def rc_order(item):
    return (item[0] is None, item[0] or 0)


def tail(text, n=8):
    return "\n".join("    " + l for l in text.rstrip().splitlines()[-n:])


def port_busy(port):
    s = socket.socket()
    s.settimeout(0.2)
    try:
        return s.connect_ex(("127.0.0.1", port)) == 0
    finally:
        s.close()


def main():
    ap = argparse.ArgumentParser(
        description="A long randomized campaign of interrupted spotune runs (see the top of "
                    "this file).")
    ap.add_argument("--interruptions", type=int, default=None,
                    help="at least this many interruptions (default 200; --quick 12)")
    ap.add_argument("--episodes", type=int, default=None,
                    help="exactly this many episodes, the interruptions shared among them "
                         "(default: as many as the interruptions need, at least one of each "
                         "mode x storage)")
    ap.add_argument("--seed", type=int, default=None, help="the campaign's random choices")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated training modes to run (default all: %s)"
                         % ", ".join(MODES))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--launcher", choices=("mpirun", "launch"), default="mpirun",
                    help="start each run with mpirun (default) or scripts/launch.sh, whose "
                         "stop hands exit 75 over a status file")
    ap.add_argument("--quick", action="store_true",
                    help="a short smoke run (a few minutes): 12 interruptions, 3 an episode")
    ap.add_argument("--spotune", default=os.path.join(REPO, "build", "spotune"),
                    help="the binary (default build/spotune)")
    ap.add_argument("--work", default=None,
                    help="work directory (default: a new one under $TMPDIR or /tmp)")
    ap.add_argument("--s3-port", type=int, default=None,
                    help="S3 port of the local server (default: the first free of "
                         "28380, 28480, ...)")
    ap.add_argument("--s3-backend-port", type=int, default=None,
                    help="first of its 3 backend ports (with --s3-port)")
    a = ap.parse_args()
    a.modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in a.modes if m not in MODES]
    if unknown or not a.modes:
        sys.exit("soak: --modes: %s (known: %s)"
                 % ("unknown " + ", ".join(unknown) if unknown else "none given",
                    ", ".join(MODES)))
    a.quota = (4, 8)  # interruptions per episode
    if a.quick:
        a.interruptions = a.interruptions or 12
        a.quota = (3, 3)
    a.interruptions = a.interruptions if a.interruptions is not None else 200
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1 << 31)
    if a.s3_port and not a.s3_backend_port:
        a.s3_backend_port = a.s3_port - 2000
    if not os.access(a.spotune, os.X_OK):
        sys.exit("soak: no %s (build it, or give --spotune)" % a.spotune)
    if shutil.which("mpirun") is None:
        sys.exit("soak: no mpirun")
    created = a.work is None
    if a.work is None:
        a.work = tempfile.mkdtemp(prefix="spotune-soak-",
                                  dir=os.environ.get("TMPDIR") or "/tmp")
    a.work = os.path.abspath(a.work)
    created = created or not os.path.exists(a.work)
    s = Soak(a)
    rc = 1

    def stopped(sig, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stopped)
    try:
        rc = s.run()
    except KeyboardInterrupt:
        log("soak: interrupted")
        s.abandon()
    finally:
        s.stop_store()
        if rc == 0 and not a.keep and created:
            shutil.rmtree(a.work, ignore_errors=True)
        else:
            log("soak: work directory kept: %s" % a.work)
    sys.exit(rc)


if __name__ == "__main__":
    main()

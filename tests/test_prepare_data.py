#!/usr/bin/env python3
"""Tests of scripts/prepare_data.py (JSONL -> spotune HDF5 dataset).

Runs the script on tests/fixtures/chat.jsonl and bad_chat.jsonl with the
committed test tokenizer (tests/fixtures/tokenizer) in a temporary directory
and checks the file format, the exact loss masks, the validation split and the
error handling. Plain Python, no test framework; exits 1 if any check fails.

    pip install -r scripts/requirements-data.txt
    python3 tests/test_prepare_data.py
"""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "prepare_data.py")
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
CHAT = os.path.join(ROOT, "tests", "fixtures", "chat.jsonl")
BAD = os.path.join(ROOT, "tests", "fixtures", "bad_chat.jsonl")
BAD_LINE = 4  # the line of bad_chat.jsonl with an unknown role


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_cli(*args):
    """The script as a user runs it, in a new process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env)
    return Result(r.returncode, r.stdout, r.stderr)


_module = None


def run(*args):
    """The script's main() in this process (saves importing transformers once per run)."""
    global _module
    if _module is None:
        spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
        _module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = _module.main(list(args))
        except SystemExit as e:  # argparse usage errors
            code = e.code
    return Result(code, out.getvalue(), err.getvalue())


def prepare(out, *extra, input=CHAT):
    r = run("--tokenizer", TOKENIZER, "--input", input, "--output", out, *extra)
    if r.returncode != 0:
        raise AssertionError(f"prepare_data.py exited {r.returncode}:\n{r.stderr}")
    return r


def load(path):
    import h5py
    with h5py.File(path, "r") as f:
        data = {k: f[k][()] for k in f.keys()}
        dtypes = {k: f[k].dtype for k in f.keys()}
        attrs = {k: f.attrs[k] for k in f.attrs.keys()}
    return data, dtypes, attrs


def documents(data):
    off = data["doc_offsets"]
    return [(data["tokens"][off[i]:off[i + 1]].tolist(), data["loss_mask"][off[i]:off[i + 1]].tolist())
            for i in range(len(off) - 1)]


def masked_runs(tokens, mask):
    """Contiguous runs of tokens whose mask is 1."""
    runs, cur = [], []
    for t, m in zip(tokens, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def key(doc):
    """A hashable form of a (tokens, mask) document."""
    return (tuple(doc[0]), tuple(doc[1]))


def records():
    with open(CHAT) as f:
        return [json.loads(line) for line in f]


class Checks:
    def __init__(self, tmp, tok):
        self.tmp, self.tok = tmp, tok
        self.all_prefix = os.path.join(tmp, "all")
        r = run_cli("--tokenizer", TOKENIZER, "--input", CHAT, "--output", self.all_prefix)
        if r.returncode != 0:
            raise AssertionError(f"prepare_data.py exited {r.returncode}:\n{r.stderr}")
        self.data, self.dtypes, self.attrs = load(self.all_prefix + ".train.h5")
        self.docs = documents(self.data)

    def test_no_val_file_without_fraction(self):
        assert os.path.exists(self.all_prefix + ".train.h5")
        assert not os.path.exists(self.all_prefix + ".val.h5"), "val file written with fraction 0"

    def test_format_and_dtypes(self):
        import numpy as np
        assert set(self.data) == {"tokens", "loss_mask", "doc_offsets"}, set(self.data)
        assert self.dtypes["tokens"] == np.uint32, self.dtypes["tokens"]
        assert self.dtypes["loss_mask"] == np.uint8, self.dtypes["loss_mask"]
        assert self.dtypes["doc_offsets"] == np.uint64, self.dtypes["doc_offsets"]
        n = len(self.data["tokens"])
        assert self.data["tokens"].ndim == 1 and self.data["loss_mask"].shape == (n,)
        assert set(np.unique(self.data["loss_mask"]).tolist()) <= {0, 1}
        assert int(self.data["tokens"].max()) < int(self.attrs["vocab_size"])

    def test_attributes(self):
        assert int(self.attrs["vocab_size"]) == len(self.tok), self.attrs["vocab_size"]
        assert int(self.attrs["eos_id"]) == self.tok.eos_token_id, self.attrs["eos_id"]
        desc = self.attrs["tokenizer"]
        desc = desc.decode() if isinstance(desc, bytes) else str(desc)
        assert "tokenizer" in desc and type(self.tok).__name__ in desc, desc

    def test_vocab_size_from_config(self):
        # A config.json with a larger vocab_size (padded embedding) wins over len(tokenizer).
        d = os.path.join(self.tmp, "model_with_config")
        os.makedirs(d)
        for fn in os.listdir(TOKENIZER):
            with open(os.path.join(TOKENIZER, fn), "rb") as src, open(os.path.join(d, fn), "wb") as dst:
                dst.write(src.read())
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "llama", "vocab_size": 512}, f)
        out = os.path.join(self.tmp, "padded")
        r = run("--tokenizer", d, "--input", CHAT, "--output", out)
        assert r.returncode == 0, r.stderr
        _, _, attrs = load(out + ".train.h5")
        assert int(attrs["vocab_size"]) == 512, attrs["vocab_size"]

    def test_doc_offsets(self):
        off = self.data["doc_offsets"].tolist()
        assert off[0] == 0 and off[-1] == len(self.data["tokens"]), off
        assert all(a < b for a, b in zip(off, off[1:])), "offsets not strictly increasing"
        assert len(off) == len(records()) + 1, (len(off), len(records()))

    def test_first_token_of_each_document_untrained(self):
        for i, (tokens, mask) in enumerate(self.docs):
            assert mask[0] == 0, f"document {i} has loss_mask 1 on its first token"

    def test_prompt_completion_mask(self):
        rec = records()[0]
        tokens, mask = self.docs[0]
        tok = self.tok
        p = tok(rec["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(rec["completion"], add_special_tokens=False)["input_ids"]
        assert tokens == [tok.bos_token_id] + p + c + [tok.eos_token_id], tokens
        assert mask == [0] * (1 + len(p)) + [1] * (len(c) + 1), mask
        runs = masked_runs(tokens, mask)
        assert len(runs) == 1 and runs[0][-1] == tok.eos_token_id
        got = tok.decode(runs[0], skip_special_tokens=True)
        assert got == rec["completion"], repr(got)

    def test_empty_prompt(self):
        i = next(k for k, r in enumerate(records()) if r.get("prompt") == "")
        rec, (tokens, mask) = records()[i], self.docs[i]
        assert tokens[0] == self.tok.bos_token_id and mask[0] == 0
        assert all(m == 1 for m in mask[1:]), mask
        assert self.tok.decode(tokens[1:], skip_special_tokens=True) == rec["completion"]

    def test_messages_mask(self):
        # Record 4 (index 3): two user/assistant exchanges.
        rec = records()[3]
        tokens, mask = self.docs[3]
        tok = self.tok
        text = tok.apply_chat_template(rec["messages"], tokenize=False)
        assert tokens == tok(text, add_special_tokens=False)["input_ids"], "not the chat template's tokens"
        want = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        runs = masked_runs(tokens, mask)
        got = [tok.decode(r, skip_special_tokens=True) for r in runs]
        assert got == want, f"masked text {got!r} != assistant turns {want!r}"
        end_id = tok.convert_tokens_to_ids("<|end|>")
        for r in runs:
            assert r[-1] == end_id, "an assistant turn's end-of-turn token is not trained"
        # Everything else (bos, role headers, user turns, the newline after <|end|>) is 0.
        assert sum(mask) == sum(len(r) for r in runs)
        header = tok.convert_tokens_to_ids("<|assistant|>")
        for t, m in zip(tokens, mask):
            if t == header or t == tok.convert_tokens_to_ids("<|user|>"):
                assert m == 0, "a role header is trained"

    def test_messages_with_system(self):
        rec = records()[1]
        tokens, mask = self.docs[1]
        got = [self.tok.decode(r, skip_special_tokens=True) for r in masked_runs(tokens, mask)]
        assert got == [rec["messages"][-1]["content"]], got

    def test_val_split(self):
        prefix = os.path.join(self.tmp, "split")
        prepare(prefix, "--val-fraction", "0.2", "--seed", "7")
        tr, _, tr_attrs = load(prefix + ".train.h5")
        va, _, va_attrs = load(prefix + ".val.h5")
        tr_docs, va_docs = documents(tr), documents(va)
        n = len(self.docs)
        assert len(va_docs) == round(0.2 * n), len(va_docs)
        assert len(tr_docs) + len(va_docs) == n
        # Split by whole documents: together they are exactly the unsplit documents, each once.
        assert sorted(map(key, tr_docs + va_docs)) == sorted(map(key, self.docs))
        # Each file keeps input order.
        order = [self.docs.index(d) for d in tr_docs]
        assert order == sorted(order), order
        assert dict(va_attrs) == dict(tr_attrs)
        # The same seed gives the same files.
        prefix2 = os.path.join(self.tmp, "split2")
        prepare(prefix2, "--val-fraction", "0.2", "--seed", "7")
        va2, _, _ = load(prefix2 + ".val.h5")
        assert documents(va2) == va_docs, "split is not deterministic"
        # Some seed picks another split (the seed is used).
        others = set()
        for seed in ("1", "2", "3"):
            p = os.path.join(self.tmp, f"split_s{seed}")
            prepare(p, "--val-fraction", "0.2", "--seed", seed)
            others.add(tuple(map(key, documents(load(p + ".val.h5")[0]))))
        assert len(others | {tuple(map(key, va_docs))}) > 1, "the seed does not change the split"

    def test_bad_file(self):
        d = os.path.join(self.tmp, "bad")
        os.makedirs(d)
        r = run_cli("--tokenizer", TOKENIZER, "--input", BAD, "--output", os.path.join(d, "out"),
                    "--val-fraction", "0.5")
        assert r.returncode == 3, f"exit {r.returncode}, stderr {r.stderr}"
        assert f"bad_chat.jsonl:{BAD_LINE}" in r.stderr, r.stderr
        assert os.listdir(d) == [], f"files left behind: {os.listdir(d)}"

    def test_bad_records(self):
        good = json.dumps({"prompt": "a", "completion": " b"})
        cases = {
            "not json": "{not json",
            "empty line": "",
            "missing completion": json.dumps({"prompt": "a"}),
            "empty completion": json.dumps({"prompt": "a", "completion": ""}),
            "empty messages": json.dumps({"messages": []}),
            "no assistant": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
            "empty content": json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": ""}]}),
            "not an object": "[1, 2]",
            "both kinds": json.dumps({"prompt": "a", "completion": "b", "messages": []}),
        }
        for what, line in cases.items():
            d = tempfile.mkdtemp(dir=self.tmp)
            path = os.path.join(d, "in.jsonl")
            with open(path, "w") as f:
                f.write(good + "\n" + good + "\n" + line + "\n" + good + "\n")
            r = run("--tokenizer", TOKENIZER, "--input", path, "--output", os.path.join(d, "out"))
            assert r.returncode == 3, f"{what}: exit {r.returncode}, stderr {r.stderr}"
            assert "in.jsonl:3" in r.stderr, f"{what}: {r.stderr}"
            assert os.listdir(d) == ["in.jsonl"], f"{what}: files left behind: {os.listdir(d)}"

    def test_usage_errors(self):
        out = os.path.join(self.tmp, "usage")
        r = run("--tokenizer", TOKENIZER, "--input", CHAT, "--output", out, "--val-fraction", "1.5")
        assert r.returncode == 2, r.returncode
        r = run("--input", CHAT, "--output", out)
        assert r.returncode == 2, r.returncode
        r = run("--tokenizer", os.path.join(self.tmp, "no-such-dir"), "--input", CHAT, "--output", out)
        assert r.returncode == 3, (r.returncode, r.stderr)
        r = run("--tokenizer", TOKENIZER, "--input", os.path.join(self.tmp, "missing.jsonl"),
                "--output", out)
        assert r.returncode == 3 and "missing.jsonl" in r.stderr, (r.returncode, r.stderr)
        assert not any(fn.startswith("usage") for fn in os.listdir(self.tmp))


def main():
    try:
        import h5py  # noqa: F401
        import numpy  # noqa: F401
        from transformers import AutoTokenizer
    except ImportError as e:
        print(f"FAIL: {e.name} is missing; pip install -r scripts/requirements-data.txt")
        return 1
    tok = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    passed = failed = 0
    with tempfile.TemporaryDirectory(prefix="spotune-prepare-data-") as tmp:
        checks = Checks(tmp, tok)
        for name in [n for n in dir(Checks) if n.startswith("test_")]:
            try:
                getattr(checks, name)()
                print(f"ok    {name}")
                passed += 1
            except Exception:
                print(f"FAIL  {name}\n{traceback.format_exc()}")
                failed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

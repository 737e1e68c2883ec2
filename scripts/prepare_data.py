#!/usr/bin/env python3
"""Turn a JSONL file of training examples into spotune's HDF5 token dataset.

    pip install -r scripts/requirements-data.txt   # transformers, tokenizers, h5py, numpy, jinja2
    python3 scripts/prepare_data.py --tokenizer MODEL_DIR --input data.jsonl \\
        --output data/mydata [--val-fraction 0.05] [--seed 0]

writes data/mydata.train.h5 (and data/mydata.val.h5 when --val-fraction > 0).

Input: one JSON object per line, either
  {"prompt": "...", "completion": "..."}
      tokens    = [bos, if the tokenizer adds one] + prompt + completion + [eos]
      loss_mask = 0 on bos and prompt, 1 on completion and eos
  {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
      tokens    = the tokenizer's chat template applied to the messages
      loss_mask = 1 on each assistant turn's content and its end-of-turn token, 0 elsewhere
Other keys in a record are ignored. The prompt may be empty; completions,
message lists and message contents may not. A messages record needs at least
one assistant turn.

The first token of every document has loss_mask 0 (nothing precedes it in the
document to predict it from).

Assistant spans are found by rendering prefixes of the conversation and
comparing token sequences, not by searching strings: for assistant message i,
the span starts where render(messages[:i], add_generation_prompt=True) stops
agreeing with the full rendering, and ends where render(messages[:i+1]) does;
inside it the mask is 1 up to and including the first special token after
the span's first token (the end-of-turn token: <|eot_id|>, <|im_end|>, </s>,
...), and 0 after it (a newline the template puts between turns, say).

Output (HDF5, one file per split): /tokens uint32 [n], /loss_mask uint8 [n],
/doc_offsets uint64 [docs + 1] (start of each document in /tokens; the last is
n); attributes vocab_size, eos_id, tokenizer. loss_mask[i] = 1 means the
prediction of tokens[i] from the tokens before it is trained. The split is by
document: a shuffle seeded by --seed picks the validation documents; both files
keep the input order.

Exit codes: 0 done; 2 usage error or missing Python packages; 3 bad input
(a bad record, named by file and line, or an unusable tokenizer directory).
No output file is left behind on error.
"""

import argparse
import json
import os
import random
import sys

REQUIREMENTS = "scripts/requirements-data.txt"
KNOWN_ROLES = ("system", "user", "assistant", "tool")


class BadInput(Exception):
    """Input the user has to fix (exit code 3)."""


# Keep in step with scripts/requirements-data.txt.
PINNED = {"numpy": "numpy==2.4.6", "h5py": "h5py==3.16.0", "tokenizers": "tokenizers==0.23.3",
          "transformers": "transformers==5.24.0", "jinja2": "jinja2==3.1.6"}


def check_imports():
    missing = []
    for mod in PINNED:
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        print(f"error: missing Python packages: {', '.join(missing)}. Install them with:\n"
              f"  pip install {' '.join(PINNED[m] for m in missing)}\n"
              f"or everything this script needs:\n  pip install -r {REQUIREMENTS}", file=sys.stderr)
        sys.exit(2)


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer
    if not os.path.isdir(model_dir):
        raise BadInput(f"{model_dir}: not a directory")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many kinds here
        raise BadInput(f"{model_dir}: cannot load a tokenizer: {e}") from e
    if tok.eos_token_id is None:
        raise BadInput(f"{model_dir}: the tokenizer has no eos token")
    vocab_size = len(tok)
    cfg_path = os.path.join(model_dir, "config.json")
    if os.path.exists(cfg_path):
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise BadInput(f"{cfg_path}: {e}") from e
        v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        if isinstance(v, int):
            vocab_size = max(vocab_size, v)
    return tok, vocab_size


class Encoder:
    """Turns records into (tokens, loss_mask) lists with one tokenizer."""

    def __init__(self, tok):
        self.tok = tok
        with_special = tok("a", add_special_tokens=True)["input_ids"]
        without = tok("a", add_special_tokens=False)["input_ids"]
        adds_bos = (tok.bos_token_id is not None and len(with_special) > len(without)
                    and with_special[0] == tok.bos_token_id)
        self.bos = [tok.bos_token_id] if adds_bos else []
        self.eos = tok.eos_token_id
        specials = set(tok.all_special_ids)
        for tid, added in getattr(tok, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                specials.add(tid)
        specials.add(self.eos)
        self.specials = specials
        self.warned_no_header = False

    def ids(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_completion(self, prompt, completion):
        p, c = self.ids(prompt), self.ids(completion)
        if not c:
            raise BadInput("completion has no tokens")
        tokens = self.bos + p + c + [self.eos]
        mask = [0] * (len(self.bos) + len(p)) + [1] * (len(c) + 1)
        return tokens, mask

    def render(self, messages, add_generation_prompt=False):
        text = self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
        return self.ids(text)

    def messages(self, messages):
        if getattr(self.tok, "chat_template", None) is None:
            raise BadInput("messages record, but the tokenizer has no chat_template")
        full = self.render(messages)
        mask = [0] * len(full)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = []
            if i:
                try:
                    head = self.render(messages[:i], add_generation_prompt=True)
                except Exception:  # some templates reject a history that ends this way
                    head = self.render(messages[:i])
                if not self.warned_no_header and head == self.render(messages[:i]):
                    self.warned_no_header = True
                    print("warning: the chat template adds nothing for add_generation_prompt; "
                          "assistant turn headers are trained along with the content", file=sys.stderr)
            start = common_prefix(head, full)
            end = common_prefix(self.render(messages[: i + 1]), full)
            if end <= start:
                raise BadInput(f"the chat template does not render message {i} (assistant) as a "
                               "prefix-stable span; cannot locate its tokens")
            for j in range(start, end):
                mask[j] = 1
                if j > start and full[j] in self.specials:
                    break  # the end-of-turn token is trained; what follows it is not
        return full, mask


def common_prefix(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def parse_record(line):
    """Validate one JSONL line; returns ("pc", prompt, completion) or ("chat", messages)."""
    if not line.strip():
        raise BadInput("empty line")
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise BadInput(f"not valid JSON: {e}") from e
    if not isinstance(rec, dict):
        raise BadInput("a record must be a JSON object")
    has_pc = "prompt" in rec or "completion" in rec
    has_msgs = "messages" in rec
    if has_pc and has_msgs:
        raise BadInput("a record has either prompt/completion or messages, not both")
    if has_msgs:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadInput("'messages' must be a non-empty list")
        clean = []
        for k, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise BadInput(f"message {k} needs 'role' and 'content'")
            if m["role"] not in KNOWN_ROLES:
                raise BadInput(f"message {k} has unknown role {m['role']!r} "
                               f"(known: {', '.join(KNOWN_ROLES)})")
            if not isinstance(m["content"], str) or not m["content"]:
                raise BadInput(f"message {k} ({m['role']}) has empty or non-string content")
            clean.append({"role": m["role"], "content": m["content"]})
        if not any(m["role"] == "assistant" for m in clean):
            raise BadInput("no assistant message: nothing to train on")
        return ("chat", clean)
    if has_pc:
        for key in ("prompt", "completion"):
            if key not in rec:
                raise BadInput(f"missing field '{key}'")
            if not isinstance(rec[key], str):
                raise BadInput(f"'{key}' must be a string")
        if not rec["completion"]:
            raise BadInput("empty completion")
        return ("pc", rec["prompt"], rec["completion"])
    raise BadInput("a record needs 'prompt' and 'completion', or 'messages'")


def read_documents(path, enc):
    """All documents of the file as a list of (tokens, mask); BadInput names file:line."""
    import numpy as np
    docs = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise BadInput(f"{path}: {e.strerror}") from e
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, start=1):
                rec = parse_record(line)
                if rec[0] == "pc":
                    tokens, mask = enc.prompt_completion(rec[1], rec[2])
                else:
                    tokens, mask = enc.messages(rec[1])
                if not tokens:
                    raise BadInput("the record has no tokens")
                mask[0] = 0
                # numpy arrays: 5 bytes a token instead of two Python ints
                docs.append((np.asarray(tokens, dtype=np.uint32), np.asarray(mask, dtype=np.uint8)))
        except BadInput as e:
            raise BadInput(f"{path}:{lineno}: {e}") from e
        except UnicodeDecodeError as e:
            raise BadInput(f"{path}:{lineno + 1}: not UTF-8: {e}") from e
        except Exception as e:  # a chat template error, say
            raise BadInput(f"{path}:{lineno}: cannot tokenize: {type(e).__name__}: {e}") from e
    if not docs:
        raise BadInput(f"{path}: no records")
    return docs


def split_documents(n_docs, val_fraction, seed):
    """Indices of train and val documents, each in input order."""
    if val_fraction <= 0:
        return list(range(n_docs)), []
    n_val = max(1, round(val_fraction * n_docs))
    if n_val >= n_docs:
        raise BadInput(f"--val-fraction {val_fraction} leaves no training documents "
                       f"({n_docs} in the input)")
    order = list(range(n_docs))
    random.Random(seed).shuffle(order)
    val = sorted(order[:n_val])
    train = sorted(order[n_val:])
    return train, val


def write_h5(path, docs, attrs):
    import h5py
    import numpy as np
    lengths = np.array([len(t) for t, _ in docs], dtype=np.uint64)
    offsets = np.zeros(len(docs) + 1, dtype=np.uint64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([t for t, _ in docs]) if docs else np.zeros(0, np.uint32)
    mask = np.concatenate([m for _, m in docs]) if docs else np.zeros(0, np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=tokens)
        f.create_dataset("loss_mask", data=mask)
        f.create_dataset("doc_offsets", data=offsets)
        f.attrs["vocab_size"] = np.int64(attrs["vocab_size"])
        f.attrs["eos_id"] = np.int64(attrs["eos_id"])
        f.attrs["tokenizer"] = attrs["tokenizer"]
    return int(offsets[-1]), int(mask.sum())


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Tokenize a JSONL file of prompt/completion or chat records into "
                    "spotune's HDF5 dataset format (OUT.train.h5 and OUT.val.h5).",
        epilog="Exit codes: 0 done, 2 usage or missing packages, 3 bad input. "
               f"Needs: pip install -r {REQUIREMENTS}")
    ap.add_argument("--tokenizer", required=True, metavar="MODEL_DIR",
                    help="local Hugging Face model or tokenizer directory (no download)")
    ap.add_argument("--input", required=True, metavar="FILE.jsonl",
                    help="input records, one JSON object a line")
    ap.add_argument("--output", required=True, metavar="OUT_PREFIX",
                    help="writes OUT_PREFIX.train.h5 and, with a validation split, OUT_PREFIX.val.h5")
    ap.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                    help="fraction of documents held out for validation, 0 <= F < 1 (default 0: no val file)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the train/val split shuffle (default 0)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.val_fraction < 1.0:
        ap.error("--val-fraction must be in [0, 1)")

    check_imports()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    outputs = [args.output + ".train.h5"] + ([args.output + ".val.h5"] if args.val_fraction > 0 else [])
    temps = [f"{p}.tmp-{os.getpid()}" for p in outputs]
    try:
        tok, vocab_size = load_tokenizer(args.tokenizer)
        docs = read_documents(args.input, Encoder(tok))
        train, val = split_documents(len(docs), args.val_fraction, args.seed)
        attrs = {"vocab_size": vocab_size, "eos_id": tok.eos_token_id,
                 "tokenizer": f"{tok.name_or_path} ({type(tok).__name__})"}
        out_dir = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(out_dir):
            raise BadInput(f"{out_dir}: output directory does not exist")
        summary = []
        for tmp, idx, name in zip(temps, [train, val], ["train", "val"]):
            n, trained = write_h5(tmp, [docs[i] for i in idx], attrs)
            summary.append(f"{name}: {len(idx)} documents, {n} tokens, {trained} trained")
        for tmp, final in zip(temps, outputs):
            os.replace(tmp, final)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)
    for line, path in zip(summary, outputs):
        print(f"{path}: {line}")
    print(f"vocab_size {vocab_size}, eos_id {tok.eos_token_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

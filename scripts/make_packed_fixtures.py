#!/usr/bin/env python3
"""Generate the Hugging Face golden values for packed documents
(tests/fixtures/hf/<case>/packed.safetensors).

data.packing documents|pad puts several documents in one window, each
attending only to itself with positions restarting at 0. The definition it
must meet is Hugging Face computing each document on its own: for every
fixture model of scripts/make_fixtures.py (with its LoRA adapter where it has
one), a few documents of different lengths are run one at a time through
transformers (+ PEFT) in float64, default position ids 0..n-1, and the sum
over documents of their summed masked token losses, and its gradients, are
written. tests/test_packing.c packs the same documents into windows and
compares. The models and adapters are the committed fixtures; nothing here
changes them.

Regenerate (from the repository root, same pinned versions as
scripts/make_fixtures.py):

    python3 scripts/make_packed_fixtures.py           # writes packed.safetensors
    python3 scripts/make_packed_fixtures.py --check   # regenerates in memory, compares

Files (F32 unless said; computed in float64, then rounded):
- tokens I32 [N]: the documents back to back; loss_mask U8 [N]
  (loss_mask[i] = 1: the prediction of token i from its document's earlier
  tokens is trained; a document's first token has no prediction);
  doc_offsets I32 [D+1].
- loss_sum [1]: sum over documents d and positions j >= 1 of d with
  loss_mask = 1 of -log softmax(logits_d[j-1])[token j], each document its
  own forward pass (input_ids = the document alone).
- count [1]: how many predictions that sums.
- grad.<name>: d loss_sum / d <name> for every trainable tensor (the adapter's
  lora_A / lora_B with LoRA; every base tensor without), names as in
  expected.safetensors / lora_expected.safetensors.
"""

import argparse
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (the shared loaders and the pinned versions)

# Document lengths in tokens: one of a single token (nothing to predict),
# short ones that share a window, and one of 13 (12 predictions).
DOC_LENS = [6, 1, 9, 4, 13, 3]
MASK_ONES_FRACTION = 0.75
CASES = ["llama_gqa", "llama_tied_llama3", "qwen2_bias", "mistral"]
SEED = 2024


def doc_loss(model, tokens, mask):
    """Summed masked next-token loss of one document (1-D tensors) and the count."""
    import torch
    ids = tokens.long().unsqueeze(0)
    logits = model(input_ids=ids).logits[0]                       # [n, V]
    logp = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logp.gather(-1, tokens[1:].long().unsqueeze(-1)).squeeze(-1)
    m = mask[1:].to(nll.dtype)
    return (nll * m).sum(), int(mask[1:].sum())


def make_case(name, root, meta, log):
    import torch
    from peft import PeftModel

    cdir = os.path.join(root, name)
    model_dir, lora_dir = os.path.join(cdir, "model"), os.path.join(cdir, "lora")
    lora = os.path.isdir(lora_dir)
    gen = torch.Generator().manual_seed(SEED + CASES.index(name))
    import json
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    n = sum(DOC_LENS)
    tokens = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    mask = (torch.rand((n,), generator=gen) < MASK_ONES_FRACTION).to(torch.uint8)
    offsets = [0]
    for length in DOC_LENS:
        offsets.append(offsets[-1] + length)
    for k in range(len(DOC_LENS)):
        mask[offsets[k]] = 0  # a document's first token is predicted from nothing

    model = mf.load_f64(model_dir)
    if lora:
        model = PeftModel.from_pretrained(model, lora_dir, is_trainable=True,
                                          local_files_only=True).double()
    trainable = {}
    for pname, p in model.named_parameters():
        if not lora:
            trainable[pname] = p
        elif p.requires_grad:
            key = pname.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.",
                                                                         ".lora_B.")
            trainable[key] = p
    total, count = torch.zeros((), dtype=torch.float64), 0
    for k in range(len(DOC_LENS)):
        lo, hi = offsets[k], offsets[k + 1]
        if hi - lo < 2:
            continue
        s, c = doc_loss(model, tokens[lo:hi], mask[lo:hi])
        total = total + s
        count += c
    total.backward()
    out = {"tokens": tokens, "loss_mask": mask,
           "doc_offsets": torch.tensor(offsets, dtype=torch.int32),
           "loss_sum": total.reshape(1), "count": torch.tensor([float(count)])}
    for key, p in trainable.items():
        assert p.grad is not None, f"{name}: no gradient for {key}"
        out["grad." + key] = p.grad
    mf.save_tensors(os.path.join(cdir, "packed.safetensors"), out, meta)
    log.append(f"{name}{' lora' if lora else ''}: {len(DOC_LENS)} documents, {count} trained "
               f"predictions, loss sum {total.item():.6f}, {len(trainable)} trainable tensors")


def generate(root):
    mods = mf.import_deps()
    mf.check_versions(mods)
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    meta = {"generator": "scripts/make_packed_fixtures.py; torch {} transformers {} peft {}".format(
        mods["torch"].__version__.split("+")[0], mods["transformers"].__version__,
        mods["peft"].__version__)}
    log = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with mf.rmsnorm_in_input_precision():
            for name in CASES:
                make_case(name, root, meta, log)
    return log


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.join(os.path.dirname(here), "tests", "fixtures", "hf")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=fixtures,
                    help="the hf fixtures directory: reads each case's model and adapter "
                         "there, writes its packed.safetensors (default: tests/fixtures/hf)")
    ap.add_argument("--check", action="store_true",
                    help="write into a temporary copy and compare byte for byte; exit 1 if "
                         "anything differs")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    fixtures = args.out
    if not args.check:
        for line in generate(fixtures):
            print(line)
        print(f"wrote packed.safetensors for {len(CASES)} cases under {fixtures}")
        return 0
    import filecmp
    import shutil
    with tempfile.TemporaryDirectory(prefix="spotune-packed-") as tmp:
        for name in CASES:
            shutil.copytree(os.path.join(fixtures, name), os.path.join(tmp, name),
                            ignore=shutil.ignore_patterns("packed.safetensors"))
        for line in generate(tmp):
            print(line)
        diffs = [name for name in CASES
                 if not filecmp.cmp(os.path.join(tmp, name, "packed.safetensors"),
                                    os.path.join(fixtures, name, "packed.safetensors"),
                                    shallow=False)]
    if diffs:
        print("differs: " + ", ".join(diffs))
        return 1
    print("identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())

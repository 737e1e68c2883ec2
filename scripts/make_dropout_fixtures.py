#!/usr/bin/env python3
"""Golden values for LoRA and DoRA trained with LoRA dropout, from PEFT.

Dropout is random, so PEFT and spotune agree only when they drop the same
values. spotune's mask is a pure function (base/base.h, a SplitMix64 counter
RNG; trainer/model_graph.c lora_input): for window w of the batch (its
sample id), layer l and projection p (q k v o gate up down = 0..6), element
i of the window's [T, in] input is kept when

    uniform(stream_w, ((l * 7 + p) << 40) + i) >= p_drop     (float32)

and scaled by 1 / (1 - p_drop) (float32), where uniform(s, c) is the top 24
bits of mix64(mix64(s) ^ c) over 2^24, stream_w = rng_stream(rng_stream(seed,
0x2001), sample_id) and rng_stream(s, t) = mix64(s ^ mix64(t +
0x632be59bd9b4e019)). This script computes the same masks, puts them in place
of PEFT's lora_dropout modules, and runs the saved adapter on the saved base
in training mode in float64 (scripts/make_fixtures.py's reference, its
helpers imported): PEFT's own forward, so DoRA's dropout form is PEFT's (the
base product on x, the DoRA term on the dropped input).

Writes tests/fixtures/hf/NAME/lora_dropout_expected.safetensors for each case
below, with p_drop 0.3, seed 1 and sample ids 0..B-1 (what tests/test_util.c
tu_hf_open gives the model): loss (F32 of the F64 value) and grad.KEY for
every adapter tensor KEY; metadata "generator" names the script, p_drop and seed.

Regenerate (from the repository root), with make_fixtures.py's pins:

    pip install torch==2.15.0 transformers==5.24.0 peft==0.21.2 safetensors==0.8.0 numpy
    python3 scripts/make_dropout_fixtures.py            # writes the files
    python3 scripts/make_dropout_fixtures.py --check    # regenerate and compare
"""

import argparse
import contextlib
import os
import sys
import tempfile
import warnings

CASES = ["llama_gqa", "qwen2_bias_dora", "llama_gqa_dora"]
P_DROP = 0.3
SEED = 1
RNG_TAG_DROPOUT = 0x2001
PROJS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
M64 = (1 << 64) - 1


def mix64(z):
    """SplitMix64's finaliser on numpy uint64 arrays (or Python ints)."""
    import numpy as np
    if isinstance(z, int):
        z = (z + 0x9E3779B97F4A7C15) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def rng_stream(seed, tag):
    return mix64(seed ^ mix64((tag + 0x632BE59BD9B4E019) & M64))


def keep_mask(stream, offset, n, p):
    """float32 multipliers (0 or 1 / (1 - p)) of elements 0..n-1 of one window."""
    import numpy as np
    ctr = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    u = (mix64(np.uint64(mix64(stream)) ^ ctr) >> np.uint64(40)).astype(np.float32) \
        * np.float32(1.0 / 16777216.0)
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    return np.where(u >= np.float32(p), scale, np.float32(0.0)).astype(np.float32)


class FixedMask:
    """A stand-in for nn.Dropout: x times a mask [B, T, in] (float64)."""

    def __new__(cls, mask):
        import torch

        class _M(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.register_buffer("m", m)

            def forward(self, x):  # as nn.Dropout: identity outside training
                if not self.training:
                    return x
                assert x.shape == self.m.shape, (tuple(x.shape), tuple(self.m.shape))
                return x * self.m

        return _M(mask)


def make_case(name, root, log):
    import numpy as np
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import make_fixtures as mf
    src = os.path.join(os.path.dirname(here), "tests", "fixtures", "hf", name)
    model_dir, lora_dir = os.path.join(src, "model"), os.path.join(src, "lora")
    batch = load_file(os.path.join(src, "batch.safetensors"))
    tokens, mask = batch["tokens"], batch["loss_mask"]
    inputs = tokens[:, :-1].long()
    B, T = inputs.shape
    base = mf.load_f64(model_dir)
    cfg = base.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dims = {p: cfg.hidden_size for p in PROJS}
    dims["o_proj"] = cfg.num_attention_heads * head_dim
    dims["down_proj"] = cfg.intermediate_size
    p64 = PeftModel.from_pretrained(base, lora_dir, is_trainable=True,
                                    local_files_only=True).double()
    p64.train()
    stream = rng_stream(SEED, RNG_TAG_DROPOUT)
    replaced = 0
    for mod_name, mod in p64.named_modules():
        if not hasattr(mod, "lora_dropout") or "default" not in mod.lora_dropout:
            continue
        parts = mod_name.split(".")
        layer, proj = int(parts[parts.index("layers") + 1]), parts[-1]
        p, n_in = PROJS.index(proj), dims[proj]
        m = np.stack([keep_mask(rng_stream(stream, w), (layer * 7 + p) << 40, T * n_in, P_DROP)
                      for w in range(B)]).reshape(B, T, n_in)
        mod.lora_dropout["default"] = FixedMask(torch.from_numpy(m).double())
        replaced += 1
    assert replaced > 0, name
    trainable = {}
    for n, prm in p64.named_parameters():
        if prm.requires_grad:
            key = n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            key = key.replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
            trainable[key] = prm
    logits = p64(input_ids=inputs).logits
    loss = mf.masked_loss(logits, tokens, mask)
    loss.backward()
    out = {"loss": loss.detach().reshape(1)}
    for k, prm in trainable.items():
        out["grad." + k] = prm.grad
    # the masks are in force: the loss is not the one without dropout
    with torch.no_grad():
        p64.eval()
        plain = mf.masked_loss(p64(input_ids=inputs).logits, tokens, mask)
    assert abs(plain.item() - loss.item()) > 1e-4 * abs(plain.item()), name
    mf.save_tensors(os.path.join(root, name, "lora_dropout_expected.safetensors"), out,
                    # one metadata key: safetensors writes a dict's keys in no fixed order
                    {"generator": f"scripts/make_dropout_fixtures.py p_drop={P_DROP} seed={SEED}"})
    log.append(f"{name}: {replaced} projections with dropout {P_DROP}, loss {loss.item():.6f} "
               f"(without dropout {plain.item():.6f}), {len(trainable)} adapter tensors")


def generate(root):
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import make_fixtures as mf
    import torch
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # float64 sums in one order: --check reproduces the bytes
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    log = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with mf.rmsnorm_in_input_precision():
            for name in CASES:
                os.makedirs(os.path.join(root, name), exist_ok=True)
                make_case(name, root, log)
    return log


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(os.path.dirname(here), "tests", "fixtures", "hf")
    ap = argparse.ArgumentParser(description="LoRA/DoRA dropout golden values from PEFT.")
    ap.add_argument("--out", default=default, help="the hf fixtures directory")
    ap.add_argument("--check", action="store_true",
                    help="generate into a temporary directory and compare byte for byte")
    args = ap.parse_args(argv)
    if not args.check:
        for line in generate(args.out):
            print(line)
        return 0
    import filecmp
    with tempfile.TemporaryDirectory(prefix="spotune-dropout-") as tmp:
        for line in generate(tmp):
            print(line)
        bad = [n for n in CASES if not filecmp.cmp(
            os.path.join(tmp, n, "lora_dropout_expected.safetensors"),
            os.path.join(args.out, n, "lora_dropout_expected.safetensors"), shallow=False)]
        if bad:
            print("differs: " + " ".join(bad))
            return 1
        print(f"identical to {args.out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())

#!/usr/bin/env python3
"""Generate the NF4 (QLoRA) golden values in tests/fixtures/nf4/.

spotune's NF4 code (kernels/nf4.c) is checked bit for bit against what
bitsandbytes computes on the CPU: 4-bit NormalFloat codes in blocks of 64
with double quantization (the per-block absmax values, minus their mean, are
quantized again to 8 bits in blocks of 256 with bitsandbytes' signed dynamic
map), and the dequantized values.

Regenerate (from the repository root):

    pip install torch==2.15.0 safetensors==0.8.0 bitsandbytes==0.50.2 numpy
    python3 scripts/make_nf4_fixtures.py            # writes tests/fixtures/nf4/
    python3 scripts/make_nf4_fixtures.py --check    # regenerate in a temp dir, compare

Generated with: torch 2.15.0, safetensors 0.8.0, bitsandbytes 0.50.2
(Python 3.11, CPU). Other versions print a warning.

matrices.safetensors holds, for each matrix NAME (metadata "matrices": a JSON
list of [NAME, rows, cols]):
  NAME.input             F32 [rows, cols]  the matrix quantized
  NAME.weight            U8  [(n+1)/2, 1]  packed codes, element 2i in the high
                                           nibble of byte i (an odd count is
                                           padded with the code of 0.0)
  NAME.absmax_f32        F32 [ceil(n/64)]  first-level absmax per block of 64
  NAME.absmax            U8  [ceil(n/64)]  the 8-bit codes of absmax - offset
  NAME.nested_absmax     F32 [ceil(blocks/256)]
  NAME.nested_offset     F32 [1]           mean of absmax_f32
  NAME.nested_quant_map  F32 [256]         as bitsandbytes stores it
  NAME.quant_map         F32 [16]          the NF4 values
  NAME.absmax_dequant    F32 [ceil(n/64)]  absmax as dequantization recovers it
  NAME.dequant           F32 [rows, cols]  bitsandbytes' reference dequantization
                                           (dequantize_reference below)
and dynamic_map F32 [256]: bitsandbytes' create_dynamic_map() (signed, 8 bits),
the map the absmax values are quantized with.

llama_gqa_qlora.safetensors: QLoRA on tests/fixtures/hf/llama_gqa (its model/,
lora/ and batch, read, not changed): every projection weight (q, k, v, o,
gate, up, down) of the float32 model replaced by bitsandbytes'
dequantize(quantize_4bit(W)) (NF4, blocksize 64, double quantization), then
the PEFT adapter's loss and LoRA gradients in float64 as
scripts/make_fixtures.py computes them (its helpers, imported):
  dequant.NAME   F32  the dequantized projection weight NAME (HF name)
  logits, loss   F64 reference, stored F32
  grad.KEY       F32  the gradient of adapter tensor KEY (PEFT's name)
Also needs transformers==5.24.0 and peft==0.21.2.

llama_gqa_qdora.safetensors: the same for QDoRA, DoRA on the NF4 base: the
model, DoRA adapter (A, B and the magnitude vectors) and batch of
tests/fixtures/hf/llama_gqa_dora, its projection weights replaced by
bitsandbytes' dequantize(quantize_4bit(W)) as above; the same keys (grad.KEY
also for the lora_magnitude_vector tensors). PEFT's DoRA on a bitsandbytes
4-bit layer computes its weight norm from the dequantized weight, which this
dense model of dequantized weights computes as well.

llama_gqa_dora_bnb/: llama_gqa_dora's model as a pre-quantized bitsandbytes
4-bit directory, as llama_gqa_bnb/ below (the base of llama_gqa_qdora).

llama_gqa_bnb/: the same model as a pre-quantized bitsandbytes 4-bit
directory, written by this script from bitsandbytes' quant states (the same
quantization as llama_gqa_qlora's base) with the names transformers gives
them when it saves a model loaded with BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True): NAME (packed
uint8), NAME.absmax, NAME.quant_map, NAME.nested_absmax,
NAME.nested_quant_map, NAME.quant_state.bitsandbytes__nf4 (the packed JSON
of QuantState.as_dict(packed=True)), the other tensors as in model/, and
config.json with the quantization_config BitsAndBytesConfig.to_dict()
writes.

llama_gqa_bnb_saved/: the same float32 model loaded by transformers itself
with that BitsAndBytesConfig (bnb_4bit_compute_dtype float32, on the CPU:
bitsandbytes 0.50 quantizes there) and written by its save_pretrained: what a
user's own `*-bnb-4bit` directory holds (config.json as transformers writes
it, generation_config.json, model.safetensors). Also needs accelerate.
The keys are QuantState.as_dict()'s names (absmax, quant_map, nested_absmax,
nested_quant_map, nested_offset) prefixed by the matrix name.
"""

import argparse
import filecmp
import json
import os
import sys
import tempfile

PINNED_VERSIONS = {
    "torch": "2.15.0",
    "safetensors": "0.8.0",
    "bitsandbytes": "0.50.2",
}

# name, rows, cols, seed, scale. odd7x37 has 259 elements (not a multiple of
# 64, odd: a padded nibble); wide96x300 has 450 blocks (two nested blocks of
# 256, the second partial).
MATRICES = [
    ("sq64x48", 64, 48, 1, 0.02),
    ("odd7x37", 7, 37, 2, 1.0),
    ("wide96x300", 96, 300, 3, 0.05),
    ("tall130x17", 130, 17, 4, 0.3),
]


def import_deps():
    try:
        import bitsandbytes
        import safetensors
        import torch
    except ImportError as e:
        print(f"error: {e.name} is missing. Install with:\n  pip install "
              + " ".join(f"{k}=={v}" for k, v in PINNED_VERSIONS.items()) + " numpy",
              file=sys.stderr)
        sys.exit(2)
    mods = {"torch": torch, "safetensors": safetensors, "bitsandbytes": bitsandbytes}
    for name, want in PINNED_VERSIONS.items():
        have = mods[name].__version__.split("+")[0]
        if have != want:
            print(f"warning: {name} {have} installed, fixtures were generated with {want}; "
                  "the regenerated files may differ", file=sys.stderr)
    return mods


def dequantize_reference(packed, absmax, qs):
    """bitsandbytes' reference NF4 dequantization (its default backend's
    kernel, the one its CPU path uses for odd widths). bitsandbytes 0.50.2's
    native CPU kernel, used for even widths, scales every block of a matrix
    of more than one row by the first block's absmax (a bug there), so it is
    not used; the difference is reported."""
    import bitsandbytes.functional as F
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code
    import torch
    code = _get_4bit_code("nf4", packed.device)
    ref = _dequantize_4bit_compute(packed.reshape(-1), absmax, code, qs.blocksize, qs.shape,
                                   torch.float32)
    native = F.dequantize_4bit(packed, qs, quant_type="nf4")
    if not torch.equal(native, ref):
        NATIVE_DIFFERS.append(tuple(qs.shape))
    return ref


NATIVE_DIFFERS = []


def quantize(W):
    """bitsandbytes' NF4 quantization with double quantization, and its parts."""
    import bitsandbytes.functional as F
    import torch
    packed, qs = F.quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4")
    # the first-level absmax, before double quantization (same op, no nesting)
    _, qs_plain = F.quantize_4bit(W, blocksize=64, compress_statistics=False, quant_type="nf4")
    d = qs.as_dict(packed=False)
    absmax_dq = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    deq = dequantize_reference(packed, absmax_dq, qs)
    return {
        "weight": packed.contiguous(),
        "absmax_f32": qs_plain.absmax.to(torch.float32),
        "absmax": d["absmax"],
        "nested_absmax": d["nested_absmax"].to(torch.float32),
        "nested_offset": torch.tensor([d["nested_offset"]], dtype=torch.float32),
        "nested_quant_map": d["nested_quant_map"].to(torch.float32),
        "quant_map": d["quant_map"].to(torch.float32),
        "absmax_dequant": absmax_dq.to(torch.float32),
        "dequant": deq.to(torch.float32),
    }, qs


def generate(out_dir):
    mods = import_deps()
    torch = mods["torch"]
    # bitsandbytes compiles its reference dequantization once per shape
    torch._dynamo.config.recompile_limit = 64
    import bitsandbytes.functional as F
    from safetensors.torch import save_file
    tensors, shapes, log = {}, [], []
    for name, rows, cols, seed, scale in MATRICES:
        g = torch.Generator().manual_seed(seed)
        W = (torch.randn(rows, cols, generator=g, dtype=torch.float32) * scale).contiguous()
        parts, qs = quantize(W)
        assert qs.blocksize == 64 and qs.state2.blocksize == 256 and qs.quant_type == "nf4"
        tensors[name + ".input"] = W
        for k, v in parts.items():
            tensors[name + "." + k] = v.contiguous()
        shapes.append([name, rows, cols])
        # the offset is a float32 mean; spotune sums in double and rounds once
        exact = float(parts["absmax_f32"].double().mean().to(torch.float32))
        if exact != float(parts["nested_offset"][0]):
            log.append(f"note: {name}: bitsandbytes' float32 mean of absmax (torch's "
                       "vectorised sum) is not the correctly rounded mean")
        err = (parts["dequant"].double() - W.double()).abs().max().item()
        log.append(f"{name}: {rows}x{cols}, {parts['absmax'].numel()} blocks, "
                   f"max |W - dequant| {err:.3g}")
    if NATIVE_DIFFERS:
        log.append("note: bitsandbytes' native CPU dequantize_4bit differs from its reference "
                   "kernel for shapes " + ", ".join(f"{r}x{c}" for r, c in NATIVE_DIFFERS))
    log += make_qlora_case(out_dir)
    log += make_qdora_case(out_dir)
    tensors["dynamic_map"] = F.create_dynamic_map().to(torch.float32)
    # one metadata key: safetensors writes a dict's keys in no fixed order
    save_file(tensors, os.path.join(out_dir, "matrices.safetensors"),
              metadata={"matrices": json.dumps(shapes)})
    return log


def write_bnb_dir(dst, model_dir, saved, quantized):
    """A bitsandbytes 4-bit model directory as transformers saves one."""
    import shutil
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True).to_dict()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    shutil.copy(os.path.join(model_dir, "generation_config.json"), dst)
    tensors = {k: v for k, v in saved.items() if k not in quantized}
    tensors.update(quantized)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def write_transformers_saved(dst, model_dir):
    """The model loaded by transformers itself with BitsAndBytesConfig (4-bit
    NF4, double quantization) on the CPU, and written by its save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    m = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=q, dtype=torch.float32,
                                             device_map="cpu", local_files_only=True)
    m.save_pretrained(dst)


def nf4_peft_case(case):
    """tests/fixtures/hf/CASE's adapter (LoRA or DoRA) on its model with every
    projection weight NF4-quantized and dequantized by bitsandbytes: the
    dequantized weights, logits, loss and adapter gradients (float64 math,
    stored float32), bitsandbytes' quant states, the model's own tensors and
    the largest |W - dequant|."""
    import warnings
    import torch
    import bitsandbytes.functional as F
    from peft import PeftModel
    from safetensors.torch import load_file
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import make_fixtures as mf
    case_dir = os.path.join(os.path.dirname(here), "tests", "fixtures", "hf", case)
    model_dir, lora_dir = os.path.join(case_dir, "model"), os.path.join(case_dir, "lora")
    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    batch = load_file(os.path.join(case_dir, "batch.safetensors"))
    tokens, mask = batch["tokens"], batch["loss_mask"]
    inputs = tokens[:, :-1].long()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    out, log, worst, bnb_dir = {}, [], 0.0, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with mf.rmsnorm_in_input_precision():
            b64 = mf.load_f64(model_dir)
            with torch.no_grad():
                for n, p in b64.named_parameters():
                    if not n.endswith("_proj.weight"):
                        continue
                    W = saved[n].to(torch.float32)
                    packed, qs = F.quantize_4bit(W, blocksize=64, compress_statistics=True,
                                                 quant_type="nf4")
                    absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
                    d = dequantize_reference(packed, absmax, qs)
                    worst = max(worst, (d - W).abs().max().item())
                    out["dequant." + n] = d
                    for k, v in qs.as_dict(packed=True).items():
                        bnb_dir[n + "." + k] = v
                    bnb_dir[n] = packed
                    p.copy_(d.double())
            assert len(out) == 7 * b64.config.num_hidden_layers
            p64 = PeftModel.from_pretrained(b64, lora_dir, is_trainable=True,
                                            local_files_only=True).double()
            trainable = {}
            for n, p in p64.named_parameters():
                if p.requires_grad:
                    key = (n.replace(".lora_A.default.", ".lora_A.")
                           .replace(".lora_B.default.", ".lora_B.")
                           .replace(".lora_magnitude_vector.default.weight",
                                    ".lora_magnitude_vector"))
                    trainable[key] = p
            logits = p64(input_ids=inputs).logits
            loss = mf.masked_loss(logits, tokens, mask)
            loss.backward()
    out["logits"] = logits.detach().to(torch.float32)
    out["loss"] = loss.detach().reshape(1).to(torch.float32)
    for k, p in trainable.items():
        out["grad." + k] = p.grad.detach().to(torch.float32)
    return out, bnb_dir, saved, model_dir, worst


def save_case(out, out_dir, name):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, name),
              metadata={"generator": "scripts/make_nf4_fixtures.py"})


def make_qlora_case(out_dir):
    """The llama_gqa fixture's LoRA loss and gradients on an NF4 base."""
    out, bnb_dir, saved, model_dir, worst = nf4_peft_case("llama_gqa")
    save_case(out, out_dir, "llama_gqa_qlora.safetensors")
    write_bnb_dir(os.path.join(out_dir, "llama_gqa_bnb"), model_dir, saved, bnb_dir)
    write_transformers_saved(os.path.join(out_dir, "llama_gqa_bnb_saved"), model_dir)
    grads = sum(k.startswith("grad.") for k in out)
    return [f"llama_gqa qlora: loss {out['loss'].item():.6f}, {grads} adapter tensors, "
            f"max |W - dequant| {worst:.3g}"]


def make_qdora_case(out_dir):
    """The llama_gqa_dora fixture's DoRA loss and gradients on an NF4 base."""
    out, bnb_dir, saved, model_dir, worst = nf4_peft_case("llama_gqa_dora")
    save_case(out, out_dir, "llama_gqa_qdora.safetensors")
    write_bnb_dir(os.path.join(out_dir, "llama_gqa_dora_bnb"), model_dir, saved, bnb_dir)
    grads = sum(k.startswith("grad.") for k in out)
    magnitudes = sum(k.endswith(".lora_magnitude_vector") for k in out)
    assert magnitudes == 14, magnitudes
    return [f"llama_gqa_dora qdora: loss {out['loss'].item():.6f}, {grads} adapter tensors "
            f"({magnitudes} magnitude vectors), max |W - dequant| {worst:.3g}"]


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(os.path.dirname(here), "tests", "fixtures", "nf4")
    ap = argparse.ArgumentParser(description="Generate NF4 golden values from bitsandbytes.")
    ap.add_argument("--out", default=default_out, help="output directory (default: tests/fixtures/nf4)")
    ap.add_argument("--check", action="store_true",
                    help="generate into a temporary directory and compare byte for byte "
                         "with --out instead of writing it; exit 1 if anything differs")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spotune-nf4-") as tmp:
        target = tmp if args.check else args.out
        os.makedirs(target, exist_ok=True)
        for line in generate(target):
            print(line)
        if args.check:
            diffs = []
            for dirpath, _, files in os.walk(tmp):
                for fn in sorted(files):
                    rel = os.path.relpath(os.path.join(dirpath, fn), tmp)
                    old = os.path.join(args.out, rel)
                    if not os.path.exists(old) or not filecmp.cmp(os.path.join(tmp, rel), old,
                                                                  shallow=False):
                        diffs.append(rel)
            if diffs:
                print("differs from " + args.out + ": " + " ".join(diffs))
                return 1
            print(f"identical to {args.out}")
            return 0
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

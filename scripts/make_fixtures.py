#!/usr/bin/env python3
"""Generate the Hugging Face golden values in tests/fixtures/hf/.

The C model code (forward, loss, backward, LoRA, adapter export) is checked
against these files. For each case this writes a tiny random model in the
Hugging Face layout, a token batch with a loss mask, and the logits, loss and
gradients that transformers (+ PEFT for LoRA) compute for it in float64.
See tests/fixtures/hf/README.md for the exact definitions.

Regenerate (from the repository root):

    pip install torch==2.15.0 transformers==5.24.0 peft==0.21.2 safetensors==0.8.0 numpy
    python3 scripts/make_fixtures.py            # writes tests/fixtures/hf/
    python3 scripts/make_fixtures.py --check    # regenerate in a temp dir, compare

Generated with: torch 2.15.0, transformers 5.24.0, peft 0.21.2,
safetensors 0.8.0 (Python 3.11, CPU). Other versions print a warning: their
random initialisation or config.json fields may differ, so the files change.
"""

import argparse
import contextlib
import filecmp
import json
import os
import shutil
import sys
import tempfile
import warnings

PINNED_VERSIONS = {
    "torch": "2.15.0",
    "transformers": "5.24.0",
    "peft": "0.21.2",
    "safetensors": "0.8.0",
}

BATCH = 2
SEQ = 11
MASK_ONES_FRACTION = 0.7
LORA_B_STD = 0.02
DORA_MAGNITUDE_JITTER = 0.1
BIAS_STD = 0.1
EMBED_STD = 0.25

LORA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Each case: architecture, config fields, LoRA settings (or None), seed.
CASES = [
    {
        "name": "llama_gqa",
        "arch": "llama",
        "config": dict(
            vocab_size=97, hidden_size=48, intermediate_size=80,
            num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            max_position_embeddings=64,
        ),
        "lora": dict(r=4, lora_alpha=8, target_modules=LORA_ALL, use_rslora=False),
        "seed": 1001,
    },
    {
        "name": "llama_tied_llama3",
        "arch": "llama",
        "config": dict(
            vocab_size=80, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=True,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
        "lora": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                     use_rslora=True),
        "seed": 1002,
    },
    {
        "name": "qwen2_bias",
        "arch": "qwen2",
        "config": dict(
            vocab_size=70, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
        ),
        "lora": dict(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
                     use_rslora=False),
        "seed": 1003,
    },
    {
        "name": "llama_gqa_dora",
        "arch": "llama",
        "config": dict(
            vocab_size=97, hidden_size=48, intermediate_size=80,
            num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            max_position_embeddings=64,
        ),
        "lora": dict(r=4, lora_alpha=8, target_modules=LORA_ALL, use_rslora=False,
                     use_dora=True),
        "seed": 1005,
    },
    {
        "name": "qwen2_bias_dora",
        "arch": "qwen2",
        "config": dict(
            vocab_size=70, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
        ),
        "lora": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "o_proj", "up_proj",
                                                        "down_proj"],
                     use_rslora=True, use_dora=True),
        "seed": 1006,
    },
    {
        "name": "mistral",
        "arch": "mistral",
        "config": dict(
            vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            sliding_window=4096, tie_word_embeddings=False,
        ),
        "lora": None,
        "seed": 1004,
    },
]


def check_versions(mods):
    """Warn (do not fail) when the installed versions differ from the pinned ones."""
    for name, want in PINNED_VERSIONS.items():
        have = mods[name].__version__.split("+")[0]
        if have != want:
            print(f"warning: {name} {have} installed, fixtures were generated with {want}; "
                  "the regenerated files may differ", file=sys.stderr)


def import_deps():
    try:
        import numpy  # noqa: F401
        import peft
        import safetensors
        import torch
        import transformers
    except ImportError as e:
        print(f"error: {e.name} is missing. Install with:\n  pip install "
              + " ".join(f"{k}=={v}" for k, v in PINNED_VERSIONS.items()) + " numpy",
              file=sys.stderr)
        sys.exit(2)
    return {"torch": torch, "transformers": transformers, "peft": peft,
            "safetensors": safetensors}


def model_class(arch):
    import transformers
    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]


def randomize_for_sensitivity(model, gen):
    """Redraw the weights so every part of the math shows in the outputs.

    HF's default init (N(0, 0.02), norm weights 1, biases 0) makes attention
    almost uniform and norm weights invisible; a wrong RoPE or a missing norm
    scale would then pass. Here: embeddings N(0, 0.25^2) (so a tied head's
    logits stay O(1)), every linear weight N(0, 1/in_features), norm weights
    1 + N(0, 0.1^2), biases N(0, 0.1^2).
    """
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
            elif p.ndim == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * EMBED_STD)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def masked_loss(logits, tokens, mask):
    """Mean over (b, j>=1, mask[b,j]=1) of -log softmax(logits[b, j-1])[tokens[b, j]]."""
    import torch
    logp = torch.log_softmax(logits, dim=-1)                     # [B, T, V]
    target = tokens[:, 1:].long()                                 # [B, T]
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)      # [B, T]
    m = mask[:, 1:].to(nll.dtype)
    return (nll * m).sum() / m.sum()


def hf_loss(model, tokens, mask):
    """HF's own loss on the same batch: input_ids = all T+1 tokens, labels masked to -100.

    The causal model's logits at positions 0..T-1 do not depend on token T, so
    this is the same quantity as masked_loss on the first T positions. HF's
    loss function casts the logits to float32 first, so it agrees with the
    float64 formula to float32 rounding only (see assert_same_loss).
    """
    labels = tokens.long().masked_fill(mask == 0, -100)
    return model(input_ids=tokens.long(), labels=labels).loss


def assert_same_loss(ours, hf, what):
    ours, hf = float(ours), float(hf)
    assert abs(ours - hf) <= 2e-6 * max(1.0, abs(ours)), f"{what}: loss {ours} vs HF {hf}"


def load_f64(model_dir):
    import torch
    _, cls = model_class_from_dir(model_dir)
    # SDPA on CPU computes a float64 input in float64; HF's eager attention
    # would take the softmax in float32.
    return cls.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa",
                               local_files_only=True)


@contextlib.contextmanager
def rmsnorm_in_input_precision():
    """Run HF's RMSNorm in float64 for float64 inputs.

    HF's Llama/Qwen2/Mistral RMSNorm casts its input to float32 whatever its
    dtype, so a float64 model would round every normalised activation to
    float32. This swaps in the same formula, computed in the wider of the
    input dtype and float32: identical for float32/bf16 inputs.
    """
    import torch
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, hidden_states):
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        x = hidden_states.to(dtype)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)

    classes = [modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_mistral.MistralRMSNorm]
    saved = [c.forward for c in classes]
    for c in classes:
        c.forward = forward
    try:
        yield
    finally:
        for c, f in zip(classes, saved):
            c.forward = f


def finite_difference_check(model, params, loss_fn, what, h=1e-5):
    """Central differences for the largest-gradient entry of each given parameter.

    An independent check that the stored gradients are d loss / d param of
    the stored loss (in float64 the two agree to about 1e-9 relative).
    """
    import torch
    for name, p in params.items():
        g = p.grad
        idx = tuple(int(i) for i in torch.unravel_index(g.abs().argmax(), g.shape))
        with torch.no_grad():
            orig = p[idx].item()
            p[idx] = orig + h
            up = loss_fn().item()
            p[idx] = orig - h
            down = loss_fn().item()
            p[idx] = orig
        fd, ad = (up - down) / (2 * h), g[idx].item()
        assert abs(fd - ad) <= 1e-9 + 1e-6 * abs(ad), \
            f"{what}: {name}{list(idx)}: finite difference {fd} vs gradient {ad}"


def model_class_from_dir(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        mt = json.load(f)["model_type"]
    return model_class(mt)


def save_tensors(path, tensors, meta):
    from safetensors.torch import save_file
    import torch
    out = {k: v.detach().to(torch.float32).contiguous() if v.is_floating_point() else v.contiguous()
           for k, v in tensors.items()}
    save_file(out, path, metadata=meta)


def rel_err(a, b):
    d = (a.double() - b.double()).abs().max().item()
    s = b.double().abs().max().item()
    return d / s if s > 0 else d


def make_case(case, root, meta, log):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors import safe_open

    name, seed = case["name"], case["seed"]
    cdir = os.path.join(root, name)
    os.makedirs(cdir)
    cfg_cls, model_cls = model_class(case["arch"])
    config = cfg_cls(**case["config"])

    # ---- model (float32, as saved) ---------------------------------------
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    randomize_for_sensitivity(model, gen)
    model_dir = os.path.join(cdir, "model")
    model.save_pretrained(model_dir, safe_serialization=True)

    # The file must hold every tensor the model needs; a tied lm_head is the
    # one allowed absence (HF re-ties it on load).
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    wanted = set(model.state_dict().keys())
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in saved, "tied lm_head unexpectedly saved"
        wanted.discard("lm_head.weight")
    assert set(saved) == wanted, f"{name}: saved keys differ: {set(saved) ^ wanted}"
    for k, v in model.state_dict().items():
        if k in saved:
            assert v.dtype == torch.float32 and saved[k].dtype == torch.float32
            assert torch.equal(v, saved[k]), k

    # ---- batch --------------------------------------------------------------
    V = config.vocab_size
    tokens = torch.randint(0, V, (BATCH, SEQ + 1), generator=gen, dtype=torch.int64).to(torch.int32)
    mask = (torch.rand((BATCH, SEQ + 1), generator=gen) < MASK_ONES_FRACTION).to(torch.uint8)
    mask[:, 0] = 0
    assert mask.sum() > 0
    save_tensors(os.path.join(cdir, "batch.safetensors"),
                 {"tokens": tokens, "loss_mask": mask}, meta)
    inputs = tokens[:, :SEQ].long()

    # ---- full model reference, float64 from the saved files -------------------
    m64 = load_f64(model_dir)
    for n, p in m64.named_parameters():
        assert p.dtype == torch.float64, n
        assert torch.equal(p.detach().to(torch.float32), model.state_dict()[n]), n
    logits = m64(input_ids=inputs).logits
    loss = masked_loss(logits, tokens, mask)
    loss.backward()
    expected = {"logits": logits, "loss": loss.reshape(1)}
    params = dict(m64.named_parameters())  # a tied lm_head is listed once, as embed_tokens
    for n, p in params.items():
        assert p.grad is not None, f"{name}: no gradient for {n}"
        expected["grad." + n] = p.grad
    if not config.tie_word_embeddings:
        assert "lm_head.weight" in params
    else:
        assert "lm_head.weight" not in params

    with torch.no_grad():
        ones = torch.ones_like(mask)
        ones[:, 0] = 0
        ref_ones = masked_loss(logits, tokens, ones)
        hf_ones = hf_loss(m64, tokens, ones)
        assert_same_loss(ref_ones, hf_ones, f"{name} all-ones mask")
        assert_same_loss(loss, hf_loss(m64, tokens, mask), f"{name} random mask")
    save_tensors(os.path.join(cdir, "expected.safetensors"), expected, meta)
    last = config.num_hidden_layers - 1
    probe = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.k_proj.weight", f"model.layers.{last}.mlp.down_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight",
             "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"]
    finite_difference_check(m64, {n: params[n] for n in probe if n in params},
                            lambda: masked_loss(m64(input_ids=inputs).logits, tokens, mask), name)

    # How far HF's own float32 (SDPA) path is from the reference: a yardstick
    # for the tolerances a float32 implementation can meet.
    m32 = model_cls.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    l32 = m32(input_ids=inputs).logits
    loss32 = masked_loss(l32, tokens, mask)
    loss32.backward()
    g32 = max(rel_err(p.grad, expected["grad." + n]) for n, p in m32.named_parameters())
    log.append(f"{name}: loss {loss.item():.6f}, max|logit| {logits.abs().max().item():.3f}, "
               f"{len(params)} params; hf float32 rel err: logits {rel_err(l32, logits):.2e}, "
               f"loss {rel_err(loss32, loss):.2e}, worst grad {g32:.2e}")

    if case["lora"] is None:
        return

    # ---- LoRA adapter (float32, as saved) -------------------------------------
    lo = case["lora"]
    dora = lo.get("use_dora", False)
    lcfg = LoraConfig(r=lo["r"], lora_alpha=lo["lora_alpha"], lora_dropout=0.0,
                      target_modules=list(lo["target_modules"]), use_rslora=lo["use_rslora"],
                      use_dora=dora, task_type="CAUSAL_LM")
    base32 = model_cls.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    torch.manual_seed(seed + 1)  # PEFT draws lora_A from the global generator
    pm = get_peft_model(base32, lcfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=gen) * LORA_B_STD)
        if dora:
            set_dora_magnitudes(pm, gen)
    lora_dir = os.path.join(cdir, "lora")
    pm.save_pretrained(lora_dir)
    tidy_adapter_dir(lora_dir)

    with safe_open(os.path.join(lora_dir, "adapter_model.safetensors"), "pt") as f:
        adapter_keys = sorted(f.keys())
        adapter = {k: f.get_tensor(k) for k in adapter_keys}
    assert adapter_keys and all(".lora_A." in k or ".lora_B." in k or
                                (dora and k.endswith(".lora_magnitude_vector"))
                                for k in adapter_keys)
    assert dora == any(k.endswith(".lora_magnitude_vector") for k in adapter_keys)

    # ---- LoRA reference, float64 from the saved files -------------------------
    b64 = load_f64(model_dir)
    p64 = PeftModel.from_pretrained(b64, lora_dir, is_trainable=True, local_files_only=True)
    p64 = p64.double()  # PEFT keeps an f32 adapter in f32; the reference is all f64
    trainable = {}
    for n, p in p64.named_parameters():
        assert p.dtype == torch.float64, n
        if p.requires_grad:
            key = n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            key = key.replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
            trainable[key] = p
    assert sorted(trainable) == adapter_keys, \
        f"{name}: trainable params differ from adapter keys: {set(trainable) ^ set(adapter_keys)}"
    for k, p in trainable.items():
        assert torch.equal(p.detach().to(torch.float32), adapter[k]), k

    llog = p64(input_ids=inputs).logits
    lloss = masked_loss(llog, tokens, mask)
    lloss.backward()
    lexp = {"logits": llog, "loss": lloss.reshape(1)}
    for k in adapter_keys:
        assert trainable[k].grad is not None, k
        lexp["grad." + k] = trainable[k].grad
    with torch.no_grad():
        assert_same_loss(masked_loss(llog, tokens, ones), hf_loss(p64, tokens, ones),
                         f"{name} lora all-ones mask")
        assert_same_loss(lloss, hf_loss(p64, tokens, mask), f"{name} lora random mask")
        shift = (llog - logits).abs().max().item()
        assert shift > 1e-3, f"{name}: the adapter barely changes the logits ({shift})"
    save_tensors(os.path.join(cdir, "lora_expected.safetensors"), lexp, meta)
    probe = [adapter_keys[0], adapter_keys[1], adapter_keys[-2], adapter_keys[-1]]
    if dora:  # one magnitude too (the keys sort A, B, magnitude per projection)
        probe.append(next(k for k in adapter_keys if k.endswith(".lora_magnitude_vector")))
    # DoRA's gradient treats ||W + s B A|| as a constant (PEFT detaches it):
    # the finite differences hold it at its value for the stored parameters.
    with dora_norms_frozen(dora):
        with torch.no_grad():
            p64(input_ids=inputs)  # the norms, from the unperturbed parameters
        finite_difference_check(p64, {k: trainable[k] for k in probe},
                                lambda: masked_loss(p64(input_ids=inputs).logits, tokens, mask),
                                name + " lora")
    log.append(f"{name} lora: loss {lloss.item():.6f}, {len(adapter_keys)} adapter tensors, "
               f"max logit shift vs base {shift:.3f}")


@contextlib.contextmanager
def dora_norms_frozen(on):
    """While on: each DoRA layer's weight norm is the one its first call computes."""
    if not on:
        yield
        return
    from peft.tuners.lora.dora import DoraLinearLayer
    saved = DoraLinearLayer.get_weight_norm
    cache = {}

    def frozen(self, *args, **kwargs):
        if id(self) not in cache:
            cache[id(self)] = saved(self, *args, **kwargs).detach().clone()
        return cache[id(self)]

    DoraLinearLayer.get_weight_norm = frozen
    try:
        yield
    finally:
        DoraLinearLayer.get_weight_norm = saved


def set_dora_magnitudes(pm, gen):
    """Give every DoRA magnitude m the row norms of W + s B A for the B just
    drawn, times 1 + N(0, DORA_MAGNITUDE_JITTER^2) per row.

    PEFT initialises m when it creates the layer, to the norms of W + s B A
    with B = 0 then; after B is redrawn, m / ||W + s B A|| would be close to
    1 only by chance. The jitter makes m / n differ from 1 so that a missing
    scale, or a norm taken with the wrong B, shows in the outputs.
    """
    import torch
    from peft.tuners.lora import LoraLayer
    with torch.no_grad():
        for _, mod in pm.named_modules():
            if not isinstance(mod, LoraLayer) or "default" not in mod.lora_magnitude_vector:
                continue
            w = mod.get_base_layer().weight
            delta = mod.lora_B["default"].weight @ mod.lora_A["default"].weight
            norm = torch.linalg.norm(w + mod.scaling["default"] * delta, dim=1)
            mag = mod.lora_magnitude_vector["default"].weight
            mag.copy_(norm * (1.0 + DORA_MAGNITUDE_JITTER * torch.randn(mag.shape, generator=gen)))


def tidy_adapter_dir(lora_dir):
    """Make PEFT's output byte-stable: drop the generated model card, sort
    target_modules (a Python set inside PEFT, so its JSON order follows the
    process's string hash seed) and clear base_model_name_or_path (it would
    hold the temporary directory the base model was loaded from).
    """
    card = os.path.join(lora_dir, "README.md")
    if os.path.exists(card):
        os.remove(card)
    path = os.path.join(lora_dir, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    if isinstance(cfg.get("target_modules"), list):
        cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg["base_model_name_or_path"] = None
    with open(path, "w") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True))


def generate(root):
    mods = import_deps()
    check_versions(mods)
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    # One key only: safetensors writes metadata in hash order, so several
    # keys would make the files differ from run to run.
    meta = {"generator": "scripts/make_fixtures.py; torch {} transformers {} peft {}".format(
        mods["torch"].__version__.split("+")[0], mods["transformers"].__version__,
        mods["peft"].__version__)}
    log = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with rmsnorm_in_input_precision():
            for case in CASES:
                make_case(case, root, meta, log)
    return log


# Files other scripts write into the case directories
# (scripts/make_packed_fixtures.py, scripts/make_dropout_fixtures.py): not
# compared here, and kept when a case directory is rewritten.
OTHER_SCRIPTS_FILES = ("packed.safetensors", "lora_dropout_expected.safetensors")


def compare_trees(a, b):
    """List of relative paths that differ between two fixture trees."""
    diffs = []
    for dirpath, _, files in os.walk(a):
        for fn in files:
            rel = os.path.relpath(os.path.join(dirpath, fn), a)
            other = os.path.join(b, rel)
            if not os.path.exists(other) or not filecmp.cmp(os.path.join(a, rel), other, shallow=False):
                diffs.append(rel)
    for dirpath, _, files in os.walk(b):
        for fn in files:
            rel = os.path.relpath(os.path.join(dirpath, fn), b)
            if fn in OTHER_SCRIPTS_FILES and dirpath != b:
                continue
            if not os.path.exists(os.path.join(a, rel)):
                diffs.append(rel)
    return sorted(set(diffs))


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(os.path.dirname(here), "tests", "fixtures", "hf")
    ap = argparse.ArgumentParser(
        description="Generate Hugging Face golden values (logits, loss, gradients, LoRA "
                    "adapters) for spotune's model tests.")
    ap.add_argument("--out", default=default_out,
                    help="output directory (default: tests/fixtures/hf). Case directories "
                         "in it are replaced; README.md is kept.")
    ap.add_argument("--check", action="store_true",
                    help="generate into a temporary directory and compare byte for byte "
                         "with --out instead of writing it; exit 1 if anything differs")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    with tempfile.TemporaryDirectory(prefix="spotune-fixtures-") as tmp:
        gen_dir = os.path.join(tmp, "new")
        os.makedirs(gen_dir)
        log = generate(gen_dir)
        for line in log:
            print(line)
        if args.check:
            view = os.path.join(tmp, "old")
            os.makedirs(view)
            for case in CASES:  # README.md is hand-written: compare the case directories only
                src = os.path.join(args.out, case["name"])
                if os.path.isdir(src):
                    shutil.copytree(src, os.path.join(view, case["name"]))
            diffs = compare_trees(gen_dir, view)
            if diffs:
                print("differs from " + args.out + ":\n  " + "\n  ".join(diffs))
                return 1
            print(f"identical to {args.out}")
            return 0
        os.makedirs(args.out, exist_ok=True)
        for case in CASES:
            dst = os.path.join(args.out, case["name"])
            kept = {}
            for fn in OTHER_SCRIPTS_FILES:
                if os.path.exists(os.path.join(dst, fn)):
                    kept[fn] = os.path.join(tmp, case["name"] + "." + fn)
                    shutil.copy(os.path.join(dst, fn), kept[fn])
            if os.path.exists(dst):
                shutil.rmtree(dst)
            shutil.copytree(os.path.join(gen_dir, case["name"]), dst)
            for fn, saved in kept.items():
                shutil.copy(saved, os.path.join(dst, fn))
    print(f"wrote {len(CASES)} cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

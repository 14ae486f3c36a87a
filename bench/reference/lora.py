"""LoRA references in numpy float64, beside hf_models.py's forward passes (whose tiny
checkpoints they adapt).

  adapter DIR OUT --config JSON [--seed N]
      writes OUT/adapter_config.json and OUT/adapter_model.safetensors as PEFT writes them
      (tensor names base_model.model.<module>.lora_A.weight [r, in], lora_B.weight [out, r]),
      A and B random and non-zero, for the modules the config's target_modules names by
      PEFT's rules (a list: the path or a name it ends in after a dot; a string: a regex of
      the whole path; "all-linear": every linear layer but lm_head), none inside a module
      modules_to_save names; and, for modules_to_save, every tensor below a module whose
      path ends in one of its names (base_model.model.<path>, the base's values moved by
      random amounts), as PEFT saves the copies it trains.
  grads DIR ADAPTER --ids JSON
      the mean next-token loss of the ids through the model with the adapter merged
      (W + scaling B A, transposed for GPT-2's Conv1D), and each adapter tensor's gradient by
      central differences: {"loss": x, "grads": {name: [values, row-major]}}.

The forward pass with the adapter merged is the same function as PEFT's unmerged one
(y = W x + scaling B A x, without dropout); the gradient is by differences, so nothing of
the code under test's backward pass is shared.
"""

import argparse
import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402


def linear_layers(config, tensors):
    """(module path, weight name, [out, in], whether stored [in, out] (Conv1D))."""
    out = []
    for name, t in tensors.items():
        if not name.endswith(".weight") or t.ndim != 2 or "wte" in name or "wpe" in name or "embed_tokens" in name:
            continue
        module = name[: -len(".weight")]
        conv = config["model_type"] == "gpt2"
        shape = [t.shape[1], t.shape[0]] if conv else list(t.shape)
        out.append((module, name, shape, conv))
    return out


def targeted(lora, module):
    targets = lora.get("target_modules")
    if targets == "all-linear":
        return module != "lm_head"
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return module in targets or any(module.endswith("." + t) for t in targets)


def saved(lora, name):
    """Whether tensor `name` trains whole: PEFT wraps every module whose path ends in a
    modules_to_save name (a plain suffix: "norm" is "input_layernorm" too) and trains all
    below it."""
    parts = name.split(".")
    modules = [".".join(parts[:i]) for i in range(1, len(parts))]
    return any(m.endswith(n) for m in modules for n in lora.get("modules_to_save") or [])


def inside_saved(lora, module):
    """PEFT keeps adapters off a module inside one modules_to_save names as whole dotted
    parts of its path."""
    return any(re.match(rf"(^|.*\.){re.escape(n)}($|\..*)", module) for n in lora.get("modules_to_save") or [])


def adapter(args):
    config, tensors = hf_models.load(args.dir)
    lora = json.loads(args.config)
    r, alpha = lora.get("r", 8), lora.get("lora_alpha", 8)
    rng = np.random.default_rng(args.seed)
    out = {}
    for module, _, (d_out, d_in), _ in linear_layers(config, tensors):
        if targeted(lora, module) and not inside_saved(lora, module):
            out[f"base_model.model.{module}.lora_A.weight"] = rng.uniform(-0.5, 0.5, (r, d_in)).astype(np.float32)
            out[f"base_model.model.{module}.lora_B.weight"] = rng.uniform(-0.5, 0.5, (d_out, r)).astype(np.float32)
    for name, t in tensors.items():
        if saved(lora, name):
            moved = t.astype(np.float64) + rng.uniform(-0.2, 0.2, t.shape)
            out[f"base_model.model.{name}"] = moved.astype(np.float32)
    os.makedirs(args.out, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(out, os.path.join(args.out, "adapter_model.safetensors"), metadata={"format": "pt"})
    written = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "bias": "none",
               "target_modules": lora["target_modules"], "fan_in_fan_out": config["model_type"] == "gpt2",
               "use_rslora": lora.get("use_rslora", False), "base_model_name_or_path": args.dir,
               "init_lora_weights": False, "lora_dropout": 0.0}
    if lora.get("modules_to_save"):
        written["modules_to_save"] = lora["modules_to_save"]
    with open(os.path.join(args.out, "adapter_config.json"), "w") as f:
        json.dump(written, f, indent=2)


def merged(config, tensors, lora, factors):
    r, alpha = lora["r"], lora["lora_alpha"]
    scaling = alpha / math.sqrt(r) if lora.get("use_rslora") else alpha / r
    t = dict(tensors)
    prefix = "base_model.model."
    t.update({k[len(prefix):]: v for k, v in factors.items() if ".lora_A." not in k and ".lora_B." not in k})
    for module, name, _, conv in linear_layers(config, tensors):
        a = factors.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            continue
        delta = scaling * factors[f"base_model.model.{module}.lora_B.weight"] @ a
        t[name] = tensors[name] + (delta.T if conv else delta)
    return t


def mean_loss(config, tensors, ids):
    forward = hf_models.gpt2_logits if config["model_type"] == "gpt2" else hf_models.llama_logits
    logits = forward(config, tensors, ids[:-1])
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -logp[np.arange(len(ids) - 1), ids[1:]].mean()


def grads(args):
    config, tensors = hf_models.load(args.dir)
    lora = json.load(open(os.path.join(args.adapter, "adapter_config.json")))
    from safetensors.numpy import load_file

    factors = {k: v.astype(np.float64) for k, v in load_file(os.path.join(args.adapter, "adapter_model.safetensors")).items()}
    ids = np.array(json.loads(args.ids))
    loss = lambda f: mean_loss(config, merged(config, tensors, lora, f), ids)  # noqa: E731
    h = 1e-5
    out = {}
    for name, value in factors.items():
        g = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            plus, minus = dict(factors), dict(factors)
            plus[name], minus[name] = value.copy(), value.copy()
            plus[name][i] += h
            minus[name][i] -= h
            g[i] = (loss(plus) - loss(minus)) / (2 * h)
        out[name] = g.reshape(-1).tolist()
    print(json.dumps({"loss": float(loss(factors)), "grads": out}))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("adapter")
    a.add_argument("dir")
    a.add_argument("out")
    a.add_argument("--config", required=True)
    a.add_argument("--seed", type=int, default=3)
    g = sub.add_parser("grads")
    g.add_argument("dir")
    g.add_argument("adapter")
    g.add_argument("--ids", required=True)
    args = parser.parse_args()
    adapter(args) if args.command == "adapter" else grads(args)


if __name__ == "__main__":
    sys.exit(main())

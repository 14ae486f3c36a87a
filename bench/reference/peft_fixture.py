"""PEFT's and transformers' own numbers for zerotrain's LoRA tests, kept as a fixture so
that CI needs no torch (run this in a venv with torch, transformers and peft; CI only
reads peft_lora.json).

  make [--out bench/reference/peft_lora.json]
      for each case: a tiny checkpoint (hf_models.py make), a text (hf_models.py text) and
      a random adapter in PEFT's format (lora.py adapter), all from numpy seeds, so a test
      re-creates the same files without torch; then PEFT's mean next-token loss of the text
      through PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter),
      the loss of merge_and_unload()'s model, the adapter_config.json and tensor names
      PEFT writes when it saves that adapter again, and the number of parameters PEFT
      trains under the case's LoraConfig (get_peft_model). Records the inputs and versions.
  score BASE ADAPTER TEXT --context N
      PEFT's loss of TEXT's windows through BASE with ADAPTER ({"loss": x}): for a test
      that checks PEFT loads what zerotrain exported (needs torch: ignored in CI).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_models  # noqa: E402

CASES = [
    {"name": "gpt2", "make": ["--family", "gpt2"],
     "lora": {"r": 2, "lora_alpha": 3, "target_modules": ["c_attn", "c_proj", "c_fc"]}},
    {"name": "llama-gqa", "make": ["--family", "llama", "--kv-heads", "2"],
     "lora": {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": "all-linear"}},
    # Whole modules beside the adapters: every MLP (its gate_proj, a target, takes no
    # adapter inside it) and every module whose path ends in "norm".
    {"name": "llama-save", "make": ["--family", "llama", "--kv-heads", "2"],
     "lora": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "gate_proj"], "modules_to_save": ["mlp", "norm"]}},
]
TEXT = ["--bytes", "2500"]
CONTEXT = 16


def make_inputs(case, root):
    """The case's checkpoint, text and adapter, made as the Rust test makes them."""
    base, adapter, text = (os.path.join(root, case["name"] + s) for s in ("", "-adapter", ".txt"))
    run = lambda script, *args: subprocess.run([sys.executable, os.path.join(HERE, script), *args], check=True)  # noqa: E731
    run("hf_models.py", "make", base, *case["make"])
    run("hf_models.py", "text", text, *TEXT)
    run("lora.py", "adapter", base, adapter, "--config", json.dumps(case["lora"]))
    return base, adapter, text


def windows_loss(model, ids, context):
    import torch

    losses = []
    with torch.no_grad():
        for w in range((len(ids) - 1) // context):
            window = torch.tensor(ids[w * context: w * context + context + 1])[None]
            logits = model(input_ids=window[:, :-1]).logits.double()
            logp = torch.log_softmax(logits, -1)[0]
            losses.append(-logp[torch.arange(context), window[0, 1:]].mean().item())
    return sum(losses) / len(losses)


def peft_model(base, adapter):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


def trainable(base, lora):
    """The parameters PEFT trains when it adapts `base` with the LoraConfig `lora`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(**lora))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def score(args):
    with open(args.text, encoding="utf-8") as f:
        ids = hf_models.encode(args.base, f.read())
    print(json.dumps({"loss": windows_loss(peft_model(args.base, args.adapter), ids, args.context)}))


def make(args):
    import peft
    import torch
    import transformers

    out = {"peft_version": peft.__version__, "transformers_version": transformers.__version__,
           "torch_version": torch.__version__, "context": CONTEXT, "text": TEXT, "cases": []}
    with tempfile.TemporaryDirectory() as root:
        for case in CASES:
            base, adapter, text = make_inputs(case, root)
            with open(text, encoding="utf-8") as f:
                ids = hf_models.encode(base, f.read())
            model = peft_model(base, adapter)
            loss = windows_loss(model, ids, CONTEXT)
            saved = os.path.join(root, case["name"] + "-saved")
            model.save_pretrained(saved)
            from safetensors.numpy import load_file

            names = sorted(load_file(os.path.join(saved, "adapter_model.safetensors")))
            with open(os.path.join(saved, "adapter_config.json")) as f:
                written = json.load(f)
            merged = windows_loss(model.merge_and_unload(), ids, CONTEXT)
            out["cases"].append({**case, "peft_loss": loss, "merged_loss": merged,
                                 "peft_written_config": written, "peft_tensor_names": names,
                                 "peft_trainable_params": trainable(base, case["lora"])})
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default=os.path.join(HERE, "peft_lora.json"))
    s = sub.add_parser("score")
    s.add_argument("base")
    s.add_argument("adapter")
    s.add_argument("text")
    s.add_argument("--context", type=int, required=True)
    args = parser.parse_args()
    make(args) if args.command == "make" else score(args)


if __name__ == "__main__":
    sys.exit(main())

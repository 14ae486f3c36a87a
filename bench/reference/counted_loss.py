"""transformers' own loss and gradients of one optimizer step on fine-tuning sequences
whose loss is on some tokens only, kept as a fixture so that CI needs no torch (run this in
a venv with torch and transformers; CI only reads counted_loss.json).

  make [--out bench/reference/counted_loss.json]
      a tiny LLaMA (hf_models.py make --family llama --kv-heads 2: numpy seeds, so a test
      re-creates it without torch), sequences of random ids with random loss masks (the
      test writes them into a token file), and transformers' numbers for them:
      - the step: every training sequence (the whole global batch of one step), each
        truncated to its first CONTEXT + 1 tokens as TRL truncates, labels -100 where its
        mask is off, through LlamaForCausalLM(input_ids, labels, num_items_in_batch=N):
        transformers' sum over the counted targets divided by N, the step's counted
        targets; its loss and the gradients of some tensors (summed over the sequences,
        as gradient accumulation sums them);
      - the mean of each sequence's own mean loss (what a mean of means gives, which the
        test shows differs);
      - the held-out sequences' loss: their counted targets' mean, each sequence alone.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MAKE = ["--family", "llama", "--kv-heads", "2"]
CONTEXT = 16
SEED = 65
# Training sequences' lengths: one longer than a row (truncated), one of two tokens.
TRAIN_LENGTHS = [9, 17, 5, 12, 20, 7, 14, 2, 11, 16, 8, 13]
HELD_LENGTHS = [10, 15]
GRADIENTS = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.norm.weight",
]


def sequences(rng, lengths, vocab):
    """Random ids, each with a mask: one or two spans of answer tokens (never the first
    token, which no target is); the sixth sequence has none counted."""
    out = []
    for i, n in enumerate(lengths):
        ids = rng.integers(3, vocab, n).tolist()
        mask = [False] * n
        if i != 5 and n > 1:
            for _ in range(1 + (i % 2)):
                a = int(rng.integers(1, n))
                b = int(rng.integers(a, n)) + 1
                for j in range(a, b):
                    mask[j] = True
        out.append({"ids": ids, "mask": mask})
    return out


def labelled(seq):
    """The row transformers is given: the first CONTEXT + 1 tokens, -100 off the mask."""
    ids, mask = seq["ids"][: CONTEXT + 1], seq["mask"][: CONTEXT + 1]
    return ids, [t if m else -100 for t, m in zip(ids, mask)]


def counted(seq):
    """Counted targets of its row: masked tokens after the first."""
    return sum(seq["mask"][1: CONTEXT + 1])


def make(args):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    root = tempfile.mkdtemp()
    base = os.path.join(root, "llama")
    subprocess.run([sys.executable, os.path.join(HERE, "hf_models.py"), "make", base, *MAKE], check=True)
    vocab = json.load(open(os.path.join(base, "config.json")))["vocab_size"]
    rng = np.random.default_rng(SEED)
    train, held = sequences(rng, TRAIN_LENGTHS, vocab - 5), sequences(rng, HELD_LENGTHS, vocab - 5)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model.train()
    n = sum(counted(s) for s in train)
    total = 0.0
    for seq in train:
        ids, labels = labelled(seq)
        out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), num_items_in_batch=n)
        out.loss.backward()
        total += out.loss.item()
    params = dict(model.named_parameters())
    grads = {name: params[name].grad.double().flatten().tolist() for name in GRADIENTS}
    with torch.no_grad():
        def mean_loss(seqs):
            losses = []
            for seq in seqs:
                if counted(seq) == 0:
                    continue
                ids, labels = labelled(seq)
                losses.append(model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item())
            return losses
        per_sequence = mean_loss(train)
        held_sum = 0.0
        for seq in held:
            ids, labels = labelled(seq)
            held_sum += model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]),
                              num_items_in_batch=1).loss.item()
    fixture = {
        "make": MAKE, "context": CONTEXT, "train": train, "held_out": held,
        "counted": n, "loss": total, "gradients": grads,
        "mean_of_sequence_means": float(np.mean(per_sequence)),
        "held_out_counted": sum(counted(s) for s in held),
        "held_out_loss": held_sum / sum(counted(s) for s in held),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default=os.path.join(HERE, "counted_loss.json"))
    args = parser.parse_args()
    make(args)


if __name__ == "__main__":
    main()

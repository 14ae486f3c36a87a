"""A LLaMA-family checkpoint of random bf16 weights for benchmarks, written tensor by
tensor (a 7B model's 13.5 GB is never in memory at once).

    python3 bench/random_checkpoint.py CONFIG_JSON OUT_DIR [--seed N]

OUT_DIR gets CONFIG_JSON's config (with torch_dtype bfloat16) and one model.safetensors
under Hugging Face's tensor names: weights normal with standard deviation 0.02, norms 1.
"""

import argparse
import json
import os
import struct

import ml_dtypes
import numpy as np


def shapes(c):
    d, v, ffn = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or d // heads
    yield "model.embed_tokens.weight", (v, d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (d,)
        yield p + "self_attn.q_proj.weight", (heads * hd, d)
        yield p + "self_attn.k_proj.weight", (kv * hd, d)
        yield p + "self_attn.v_proj.weight", (kv * hd, d)
        yield p + "self_attn.o_proj.weight", (d, heads * hd)
        yield p + "post_attention_layernorm.weight", (d,)
        yield p + "mlp.gate_proj.weight", (ffn, d)
        yield p + "mlp.up_proj.weight", (ffn, d)
        yield p + "mlp.down_proj.weight", (d, ffn)
    yield "model.norm.weight", (d,)
    if not c.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    config["torch_dtype"] = "bfloat16"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    tensors = list(shapes(config))
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(args.seed)
    with open(os.path.join(args.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name, shape in tensors:
            if len(shape) == 1:
                values = np.ones(shape, dtype=np.float32)
            else:
                values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            f.write(values.astype(ml_dtypes.bfloat16).tobytes())


if __name__ == "__main__":
    main()

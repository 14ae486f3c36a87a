"""PyTorch on one GPU (eager, or `--compile`), beside `zerotrain bench gpu --model llama`: a
LLaMA-family model of a Hugging Face `config.json` (RMSNorm, rotary positions, grouped-query
attention through `scaled_dot_product_attention` with `enable_gqa`, a SwiGLU MLP, an untied
or tied head), random weights at the config's `initializer_range`, the same batch and AdamW
step.

    python3 bench/pytorch/gpu_llama.py --config configs/models/llama-1b.json --context 2048 --batch 2 --precision bf16
    zerotrain bench gpu --model llama --context 2048 --batch 2 --precision bf16 --stages 0

Prints the same columns as gpu_gpt.py and `zerotrain bench gpu`. Written without a GPU or
PyTorch at hand: first run it where both are (bench/gpu/verify.sh, part `families`).
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

from timing import median_step, report

FAMILIES = ("llama", "mistral", "qwen2")


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["hidden_size"], c["head_dim"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        bias = c["model_type"] == "qwen2"
        self.heads, self.kv, self.hd = heads, kv, hd
        self.input_layernorm = nn.RMSNorm(d, eps=c["rms_norm_eps"])
        self.q_proj = nn.Linear(d, heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=bias)
        self.o_proj = nn.Linear(heads * hd, d, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=c["rms_norm_eps"])
        self.gate_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], d, bias=False)

    def forward(self, h, cos, sin):
        b, t, _ = h.shape
        x = self.input_layernorm(h)
        q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        h = h + self.o_proj(a.transpose(1, 2).reshape(b, t, self.heads * self.hd))
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate(x, cos, sin):
    """Hugging Face's rotary embedding: x cos + rotate_half(x) sin, halves (not pairs) rotated."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
        self.lm_head = None if c["tie_word_embeddings"] else nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        hd = c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=c["initializer_range"])
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens):
        ids, targets = tokens[:, :-1], tokens[:, 1:]
        t = ids.shape[1]
        freqs = torch.outer(torch.arange(t, device=ids.device, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        h = self.embed_tokens(ids)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        logits = self.lm_head(h) if self.lm_head is not None else h @ self.embed_tokens.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def read_config(path):
    with open(path) as f:
        c = json.load(f)
    if c.get("model_type") not in FAMILIES:
        raise SystemExit(f"{path}: model_type {c.get('model_type')!r} is not one of {FAMILIES}")
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    c.setdefault("rms_norm_eps", 1e-6)
    c.setdefault("rope_theta", 10000.0)
    c.setdefault("tie_word_embeddings", False)
    c.setdefault("initializer_range", 0.02)
    return c


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/models/llama-1b.json")
    for name, default in [("context", 2048), ("batch", 2), ("steps", 10)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16",
                        help="bf16: autocast with fp32 master weights, as the engine's mixed precision")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    c = read_config(args.config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1)
    model = Llama(c).to(device)
    params = sum(p.numel() for p in model.parameters())
    forward = torch.compile(model) if args.compile else model
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, eps=1e-8)
    generator = torch.Generator().manual_seed(0)

    def tokens(_step):
        return torch.randint(0, c["vocab_size"], (args.batch, args.context + 1), generator=generator).to(device)

    seconds = median_step(forward, optim, tokens, args.steps, args.precision, device)
    mode = "torch.compile" if args.compile else "eager"
    what = f"{mode}, {c['model_type']} of {args.config}, {args.precision}"
    report(what, params, seconds, args.batch, args.context, args.peak_tflops, device)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Tiny Hugging Face checkpoints, and a reference forward pass written in numpy.

Independent of zerotrain: the checkpoints are written with Python's `safetensors` (numpy
API), the tokenizer is trained with Python's `tokenizers`, and the forward passes follow
the families' published definitions (GPT2LMHeadModel; LlamaForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM / MistralForCausalLM),
in float64. zerotrain's tests compare `zerotrain eval` with `loss` below.

    hf_models.py make DIR --family gpt2|llama|qwen2|qwen3|mistral [--layers N] [--kv-heads N] [--tied]
                 [--rope none|linear|llama3] [--dtype f32|bf16|f16] [--shards N] [--seed S]
                 [--layout v4|v5] [--sliding-window N]
    hf_models.py loss DIR TEXT --context N      -> {"loss": mean next-token loss per token}
    hf_models.py text FILE [--bytes N]          -> deterministic English-like text
    hf_models.py greedy DIR PROMPT [--tokens N] -> {"text", "prompt_ids", "ids": the prompt's greedy
                                                    continuation, "margin": the least gap between
                                                    the two likeliest logits}
    hf_models.py ids DIR TEXT                   -> {"ids": the tokenizer's ids of the file,
                                                    "eos": the id of tokenizer_config.json's eos_token,
                                                    "endoftext", "begin": the ids of <|endoftext|>
                                                    and <|begin_of_text|>}
"""

import argparse
import json
import math
import os
import sys

import numpy as np


# ---------------------------------------------------------------- text and tokenizer

WORDS = ("the a model trains on text and learns which word comes next while every rank holds "
         "only its shard of the optimizer state gradients and parameters so memory falls with "
         "the number of ranks zero stage one two three offload to host memory or nvme pipeline "
         "stages replica groups checkpoints resume at any world size").split()


def make_text(n_bytes, seed=7):
    rng = np.random.default_rng(seed)
    out, size = [], 0
    while size < n_bytes:
        n = int(rng.integers(4, 14))
        sentence = " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n))
        sentence = sentence[0].upper() + sentence[1:] + ". "
        if rng.random() < 0.2:
            sentence += "\n"
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


def train_tokenizer(text, vocab_size, begin=False, kind="byte-level"):
    """A byte-level BPE, or (`kind` "metaspace") a SentencePiece-style one as LLaMA 2's,
    Mistral's and TinyLlama's: words marked by a leading "\u2581", a space put before the
    text's first word and taken off again when decoding. With `begin`, one that puts
    <|begin_of_text|> before every text, as LLaMA 3's post-processor does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        alphabet = sorted(set(text.replace(" ", "\u2581")))
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_end|>"] + (["<|begin_of_text|>"] if begin else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([text], trainer)
    if begin:
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def encode(dir_, text):
    """The ids transformers' tokenizer(text) gives: the text's, with the special tokens the
    tokenizer's post-processor adds (none for GPT-2's and Qwen2's; LLaMA's beginning token)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(dir_, "tokenizer.json")).encode(text).ids


def eos_id(dir_):
    """The id of the end token transformers' AutoTokenizer takes: tokenizer_config.json's
    eos_token (a string or an added token's content); None without that file."""
    from tokenizers import Tokenizer

    path = os.path.join(dir_, "tokenizer_config.json")
    if not os.path.exists(path):
        return None
    eos = json.load(open(path))["eos_token"]
    name = eos["content"] if isinstance(eos, dict) else eos
    return Tokenizer.from_file(os.path.join(dir_, "tokenizer.json")).token_to_id(name)


def tokenizer_files(dir_, family, tok):
    """The files transformers writes beside tokenizer.json and config.json: the end token
    (Qwen2's chat models end on <|im_end|>, as here), a chat template, sampling defaults."""
    eos = "<|im_end|>" if family == "qwen2" else "<|endoftext|>"
    files = {
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                                  "eos_token": {"content": eos, "special": True}, "model_max_length": 128,
                                  "chat_template": "{% for m in messages %}{{ m['content'] }}" + eos + "{% endfor %}"},
        "special_tokens_map.json": {"eos_token": eos},
        "generation_config.json": {"eos_token_id": tok.token_to_id(eos), "do_sample": True, "top_k": 20},
    }
    for name, content in files.items():
        with open(os.path.join(dir_, name), "w") as f:
            json.dump(content, f, indent=2)


# ---------------------------------------------------------------- checkpoints

def configs(family, layers, kv_heads, tied, rope, vocab, size="tiny", extra=None):
    if size == "1b":
        # TinyLlama-1.1B's shape (1,100,048,384 parameters), for the import benchmark.
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
                "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": layers or 22,
                "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
                "initializer_range": 0.02}
    if family == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
                "n_positions": 64, "n_embd": 32, "n_layer": layers, "n_head": 4, "n_inner": None,
                "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
                "tie_word_embeddings": True}
    config = {"model_type": family, "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 500.0,
              "tie_word_embeddings": tied, "hidden_act": "silu", "initializer_range": 0.02}
    config["architectures"] = [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                "mistral": "MistralForCausalLM"}.get(family, "LlamaForCausalLM")]
    config.update(extra or {})
    if rope == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    elif rope == "llama3":
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return config


def v5_layout(config):
    """The config as transformers 5 writes it: the rotary base and scaling in one
    `rope_parameters` object (no `rope_theta`, no `rope_scaling`), `dtype` for `torch_dtype`."""
    config = dict(config)
    config["dtype"] = config.pop("torch_dtype")
    if config["model_type"] != "gpt2":
        rope = dict(config.pop("rope_scaling", None) or {"rope_type": "default"})
        rope["rope_theta"] = config.pop("rope_theta")
        config["rope_parameters"] = rope
    return config


def tensors_of(config, rng, dtype="f32"):
    """Random weights, large enough that every part of the forward pass matters."""
    np_dtype = np_dtype_of(dtype)

    def w(*shape, std=0.2):
        return rng.normal(0.0, std, shape).astype(np_dtype)

    def norm(d):
        return (1.0 + 0.1 * rng.normal(size=d)).astype(np_dtype)

    t = {}
    if config["model_type"] == "gpt2":
        d, v, inner = config["n_embd"], config["vocab_size"], 4 * config["n_embd"]
        t["transformer.wte.weight"] = w(v, d)
        t["transformer.wpe.weight"] = w(config["n_positions"], d, std=0.1)
        for i in range(config["n_layer"]):
            p = f"transformer.h.{i}."
            t[p + "ln_1.weight"], t[p + "ln_1.bias"] = norm(d), 0.1 * rng.normal(size=d)
            t[p + "attn.c_attn.weight"], t[p + "attn.c_attn.bias"] = w(d, 3 * d), w(3 * d, std=0.1)
            t[p + "attn.c_proj.weight"], t[p + "attn.c_proj.bias"] = w(d, d), w(d, std=0.1)
            t[p + "ln_2.weight"], t[p + "ln_2.bias"] = norm(d), 0.1 * rng.normal(size=d)
            t[p + "mlp.c_fc.weight"], t[p + "mlp.c_fc.bias"] = w(d, inner), w(inner, std=0.1)
            t[p + "mlp.c_proj.weight"], t[p + "mlp.c_proj.bias"] = w(inner, d), w(d, std=0.1)
        t["transformer.ln_f.weight"], t["transformer.ln_f.bias"] = norm(d), 0.1 * rng.normal(size=d)
        return t
    d, v, ffn = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    qwen = config["model_type"] == "qwen2"
    attention_bias = config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False)
    t["model.embed_tokens.weight"] = w(v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "self_attn.q_proj.weight"] = w(heads * hd, d)
        t[p + "self_attn.k_proj.weight"] = w(kv * hd, d)
        t[p + "self_attn.v_proj.weight"] = w(kv * hd, d)
        t[p + "self_attn.o_proj.weight"] = w(d, heads * hd)
        if config["model_type"] == "qwen3":
            t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = norm(hd), norm(hd)
        if qwen or attention_bias:
            for n, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
                t[p + f"self_attn.{n}_proj.bias"] = w(rows, std=0.1)
        if attention_bias and not qwen:
            t[p + "self_attn.o_proj.bias"] = w(d, std=0.1)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        t[p + "mlp.gate_proj.weight"] = w(ffn, d)
        t[p + "mlp.up_proj.weight"] = w(ffn, d)
        t[p + "mlp.down_proj.weight"] = w(d, ffn)
        if mlp_bias:
            for n, rows in (("gate", ffn), ("up", ffn), ("down", d)):
                t[p + f"mlp.{n}_proj.bias"] = w(rows, std=0.1)
    t["model.norm.weight"] = norm(d)
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    return t


def np_dtype_of(dtype):
    if dtype == "bf16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return {"f32": np.float32, "f16": np.float16}[dtype]


def save(dir_, tensors, dtype, shards):
    from safetensors.numpy import save_file

    np_dtype = np_dtype_of(dtype)
    cast = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()}
    names = list(cast)
    if shards <= 1:
        save_file(cast, os.path.join(dir_, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: cast[k] for k in part}, os.path.join(dir_, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    total = sum(v.nbytes for v in cast.values())
    with open(os.path.join(dir_, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def make(args):
    os.makedirs(args.dir, exist_ok=True)
    tok = train_tokenizer(make_text(20000, seed=args.seed), 300, begin=args.family == "llama", kind=args.tokenizer)
    tok.save(os.path.join(args.dir, "tokenizer.json"))
    tokenizer_files(args.dir, args.family, tok)
    vocab = tok.get_vocab_size() + 5  # a model's table may be larger than its tokenizer
    kv = args.kv_heads or 4
    layers = args.layers or (22 if args.size == "1b" else 2)
    extra = {}
    if args.head_dim:
        extra["head_dim"] = args.head_dim
    if args.biases:
        extra.update({"attention_bias": True, "mlp_bias": True})
    if args.sliding_window:
        extra["sliding_window"] = args.sliding_window
    config = configs(args.family, layers, kv, args.tied, args.rope, vocab, args.size, extra)
    config["torch_dtype"] = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[args.dtype]
    if args.layout == "v5":
        config = v5_layout(config)
    with open(os.path.join(args.dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save(args.dir, tensors_of(config, np.random.default_rng(args.seed), args.dtype), args.dtype, args.shards)


# ---------------------------------------------------------------- reference forward passes

def load(dir_):
    import ml_dtypes  # noqa: F401  (numpy learns bfloat16)
    from safetensors.numpy import load_file

    with open(os.path.join(dir_, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(dir_, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    t = {}
    for file in files:
        t.update({k: v.astype(np.float64) for k, v in load_file(os.path.join(dir_, file)).items()})
    return config, t


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def causal_attention(q, k, v, window=None):
    """q [h, t, hd], k and v [h, t, hd] (kv heads already repeated); with a sliding
    `window`, query i sees keys j with i - window < j <= i."""
    t, hd = q.shape[1], q.shape[2]
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    hidden = (j > i) | ((j <= i - window) if window else False)
    scores = np.where(hidden, -np.inf, scores)
    return softmax(scores) @ v


def layer_norm(x, w, b, eps):
    m = x.mean(-1, keepdims=True)
    var = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(var + eps) * w + b


def gpt2_logits(c, t, ids):
    d, heads, eps = c["n_embd"], c["n_head"], c.get("layer_norm_epsilon", 1e-5)
    n = len(ids)
    h = t["transformer.wte.weight"][ids] + t["transformer.wpe.weight"][:n]
    for i in range(c["n_layer"]):
        p = f"transformer.h.{i}."
        a = layer_norm(h, t[p + "ln_1.weight"], t[p + "ln_1.bias"], eps)
        qkv = a @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]
        q, k, v = (qkv[:, j * d:(j + 1) * d].reshape(n, heads, d // heads).transpose(1, 0, 2) for j in range(3))
        ctx = causal_attention(q, k, v).transpose(1, 0, 2).reshape(n, d)
        h = h + ctx @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
        m = layer_norm(h, t[p + "ln_2.weight"], t[p + "ln_2.bias"], eps)
        up = m @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"]
        gelu = 0.5 * up * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (up + 0.044715 * up ** 3)))
        h = h + gelu @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
    h = layer_norm(h, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], eps)
    return h @ t["transformer.wte.weight"].T


def inverse_frequencies(c, hd):
    # transformers 5 keeps the base and the scaling together in rope_parameters
    s = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c["rope_parameters"]["rope_theta"] if "rope_parameters" in c else c.get("rope_theta", 10000.0)
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv / s["factor"]
    if kind == "llama3":
        old, factor = s["original_max_position_embeddings"], s["factor"]
        low, high = s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return np.where(medium, (1 - smooth) * inv / factor + smooth * inv, out)
    return inv


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def llama_logits(c, t, ids):
    d, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads)
    hd = c.get("head_dim", d // heads)
    eps = c.get("rms_norm_eps", 1e-6)
    n = len(ids)

    def rms(x, w):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w

    def proj(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    # Mistral's window is on in every layer (Qwen2's, per layer, is not written here)
    assert not c.get("use_sliding_window"), "Qwen2's sliding window is not in this reference"
    window = c.get("sliding_window") if c["model_type"] == "mistral" else None
    angles = np.arange(n, dtype=np.float64)[:, None] * inverse_frequencies(c, hd)[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    h = t["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"])
        q = proj(x, p + "self_attn.q_proj").reshape(n, heads, hd).transpose(1, 0, 2)
        k = proj(x, p + "self_attn.k_proj").reshape(n, kv, hd).transpose(1, 0, 2)
        if p + "self_attn.q_norm.weight" in t:  # Qwen3: each head's queries and keys, before rotating
            q, k = rms(q, t[p + "self_attn.q_norm.weight"]), rms(k, t[p + "self_attn.k_norm.weight"])
        v = proj(x, p + "self_attn.v_proj").reshape(n, kv, hd).transpose(1, 0, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)
        ctx = causal_attention(q, k, v, window).transpose(1, 0, 2).reshape(n, heads * hd)
        h = h + proj(ctx, p + "self_attn.o_proj")
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        gate = proj(x, p + "mlp.gate_proj")
        h = h + proj(gate / (1 + np.exp(-gate)) * proj(x, p + "mlp.up_proj"), p + "mlp.down_proj")
    h = rms(h, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else t["lm_head.weight"]
    return h @ head.T


def loss(args):
    config, tensors = load(args.dir)
    with open(args.text, encoding="utf-8") as f:
        ids = np.array(encode(args.dir, f.read()))
    forward = gpt2_logits if config["model_type"] == "gpt2" else llama_logits
    n = args.context
    losses = []
    for w in range((len(ids) - 1) // n):
        window = ids[w * n: w * n + n + 1]
        logits = forward(config, tensors, window[:-1])
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        losses.append(-logp[np.arange(n), window[1:]].mean())
    print(json.dumps({"loss": float(np.mean(losses)), "windows": len(losses)}))


def greedy(args):
    """The prompt's greedy continuation by the reference forward pass: the prompt encoded as
    transformers' tokenizer(prompt) does, then the most likely token `--tokens` times."""
    from tokenizers import Tokenizer

    config, tensors = load(args.dir)
    forward = gpt2_logits if config["model_type"] == "gpt2" else llama_logits
    ids = encode(args.dir, args.prompt)
    start, margin = len(ids), math.inf
    for _ in range(args.tokens):
        logits = forward(config, tensors, np.array(ids))[-1]
        top = np.sort(logits)
        margin = min(margin, float(top[-1] - top[-2]))
        ids.append(int(np.argmax(logits)))
    # As transformers decodes a generation: prompt and continuation together (a SentencePiece
    # tokenizer's decoder takes the space off the first word only), the prompt as given.
    tok = Tokenizer.from_file(os.path.join(args.dir, "tokenizer.json"))
    whole, head = tok.decode(ids, skip_special_tokens=False), tok.decode(ids[:start], skip_special_tokens=False)
    text = args.prompt + whole[len(head):] if whole.startswith(head) else whole
    print(json.dumps({"text": text, "prompt_ids": ids[:start], "ids": ids[start:], "margin": margin}))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--family", choices=["gpt2", "llama", "qwen2", "qwen3", "mistral"], required=True)
    m.add_argument("--layers", type=int, default=0, help="default 2 (tiny) or 22 (1b)")
    m.add_argument("--kv-heads", type=int, default=0)
    m.add_argument("--tied", action="store_true")
    m.add_argument("--rope", choices=["none", "linear", "llama3"], default="none")
    m.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    m.add_argument("--shards", type=int, default=1)
    m.add_argument("--seed", type=int, default=1)
    m.add_argument("--tokenizer", choices=["byte-level", "metaspace"], default="byte-level",
                   help="a byte-level BPE (GPT-2, LLaMA 3, Qwen) or a SentencePiece-style one (LLaMA 2, Mistral)")
    m.add_argument("--size", choices=["tiny", "1b"], default="tiny")
    m.add_argument("--head-dim", type=int, default=0, help="a head_dim other than hidden_size / heads")
    m.add_argument("--biases", action="store_true", help="attention_bias and mlp_bias (LLaMA)")
    m.add_argument("--sliding-window", type=int, default=0, help="sliding_window (Mistral: every layer)")
    m.add_argument("--layout", choices=["v4", "v5"], default="v4",
                   help="config.json as transformers 4 writes it, or as 5 does (rope_parameters, dtype)")
    l_ = sub.add_parser("loss")
    l_.add_argument("dir")
    l_.add_argument("text")
    l_.add_argument("--context", type=int, required=True)
    t = sub.add_parser("text")
    t.add_argument("file")
    t.add_argument("--bytes", type=int, default=4000)
    t.add_argument("--seed", type=int, default=11)
    i = sub.add_parser("ids")
    i.add_argument("dir")
    i.add_argument("text")
    g = sub.add_parser("greedy")
    g.add_argument("dir")
    g.add_argument("prompt")
    g.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    if args.command == "greedy":
        greedy(args)
    elif args.command == "make":
        make(args)
    elif args.command == "loss":
        loss(args)
    elif args.command == "text":
        with open(args.file, "w", encoding="utf-8") as f:
            f.write(make_text(args.bytes, seed=args.seed))
    else:
        with open(args.text, encoding="utf-8") as f:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(os.path.join(args.dir, "tokenizer.json"))
            print(json.dumps({"ids": encode(args.dir, f.read()), "eos": eos_id(args.dir),
                              "endoftext": tok.token_to_id("<|endoftext|>"),
                              "begin": tok.token_to_id("<|begin_of_text|>")}))


if __name__ == "__main__":
    sys.exit(main())

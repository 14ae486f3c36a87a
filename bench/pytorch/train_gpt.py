"""PyTorch DDP and FSDP2 (gloo, CPU) on the same GPT as `zerotrain bench engine`.

Prints a step-time table (median ms over measured steps, rank 0) beside which
`zerotrain bench engine` can be read, on the same machine:

    python3 -m pip install torch --index-url https://download.pytorch.org/whl/cpu
    python3 bench/pytorch/train_gpt.py --world-size 2 --steps 10
    cargo run -- bench engine --world-sizes 2 --steps 10

Model: 4 pre-norm blocks of width 128, 4 heads, no key bias, 4x GELU MLP, tied head,
context 64, vocabulary 13; 8 sequences per rank; AdamW lr 1e-3, no weight decay; fp32.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, LAYERS, HEADS, CONTEXT, PER_RANK = 13, 128, 4, 4, 64, 8


class Block(nn.Module):
    def __init__(self, width=WIDTH, heads=HEADS):
        super().__init__()
        self.heads = heads
        self.norm_attn, self.norm_mlp = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=name != "k") for name in "qkvo")
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm_attn(x)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm_mlp(x))))


class Gpt(nn.Module):
    def __init__(self, vocab=VOCAB, width=WIDTH, layers=LAYERS, heads=HEADS, context=CONTEXT):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1] - 1, device=tokens.device)
        x = self.token(tokens[:, :-1]) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.token.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def run(rank, world_size, mode, steps, out):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(1)
    model = Gpt()
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        # FSDP2 (fully_shard): FSDP1 refuses to run without an accelerator.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, eps=1e-8)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        tokens = torch.randint(0, VOCAB, (PER_RANK, CONTEXT + 1), generator=generator)
        loss = model(tokens)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    if rank == 0:
        out.put((mode, statistics.median(times)))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() // args.world_size))
    queue = mp.get_context("spawn").SimpleQueue()
    rows = []
    for mode in ["ddp", "fsdp"]:
        mp.spawn(run, args=(args.world_size, mode, args.steps, queue), nprocs=args.world_size)
        rows.append(queue.get())
    params = sum(p.numel() for p in Gpt().parameters())
    print(f"PyTorch {torch.__version__}, {params} parameters, {args.world_size} ranks, {PER_RANK} sequences of {CONTEXT} tokens per rank")
    for mode, seconds in rows:
        print(f"  {mode:<5} {seconds * 1e3:8.1f} ms/step")


if __name__ == "__main__":
    main()

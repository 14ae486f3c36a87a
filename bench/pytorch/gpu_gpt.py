"""PyTorch on one GPU (eager, or `--compile` for torch.compile), beside `zerotrain bench gpu`: the same GPT (train_gpt.py's
model: pre-norm blocks, no key bias, 4x GELU MLP, tied head), batch and AdamW step.

    python3 bench/pytorch/gpu_gpt.py --layers 12 --width 768 --heads 12 --context 1024 --batch 8
    zerotrain bench gpu --layers 12 --width 768 --heads 12 --context 1024 --batch 8

Prints the same columns as `zerotrain bench gpu`: median step time, tokens/s, model TFLOPS
(6 x parameters x tokens / time) and their share of --peak-tflops, and the memory the
CUDA caching allocator holds live after a step and at its peak.
"""
import argparse

import torch

from timing import median_step, report
from train_gpt import Gpt


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    for name, default in [("layers", 12), ("width", 768), ("heads", 12), ("context", 1024), ("vocab", 50304),
                          ("batch", 8), ("steps", 10)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: autocast with fp32 master weights, as the engine's mixed precision")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--compile", action="store_true",
                        help="run the model through torch.compile (its compilation happens in the warm-up steps)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1)
    model = Gpt(args.vocab, args.width, args.layers, args.heads, args.context).to(device)
    params = sum(p.numel() for p in model.parameters())
    forward = torch.compile(model) if args.compile else model
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, eps=1e-8)
    generator = torch.Generator().manual_seed(0)

    def tokens(_step):
        return torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=generator).to(device)

    seconds = median_step(forward, optim, tokens, args.steps, args.precision, device)
    mode = "torch.compile" if args.compile else "eager"
    report(f"{mode}, {args.precision}", params, seconds, args.batch, args.context, args.peak_tflops, device)


if __name__ == "__main__":
    main()

"""The step loop and the report line gpu_gpt.py and gpu_llama.py share: the median time of
`steps` AdamW steps after 2 warm-up steps, and the columns of `zerotrain bench gpu`."""
import statistics
import time

import torch


def median_step(forward, optim, tokens, steps, precision, device):
    """Median seconds of a training step: `forward(batch)` gives the loss (under bf16
    autocast when `precision` is bf16), backward, `optim.step()`; `tokens(step)` gives the
    batch. Two warm-up steps first (torch.compile compiles in them)."""
    times = []
    for step in range(steps + 2):
        batch = tokens(step)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = forward(batch)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(what, params, seconds, batch, context, peak_tflops, device):
    """Prints the run and its step time, tokens/s, model TFLOPS (6 x parameters x tokens /
    time), MFU, and the CUDA caching allocator's live and peak MiB."""
    tokens_per_s = batch * context / seconds
    tflops = 6 * params * tokens_per_s / 1e12
    cuda = device.type == "cuda"
    live = torch.cuda.memory_allocated() / 2**20 if cuda else float("nan")
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    print(f"PyTorch {torch.__version__} {what} on {device}, {params / 1e6:.1f}M parameters, "
          f"{batch} sequences of {context} tokens")
    print(f"step {seconds * 1e3:.1f} ms, {tokens_per_s:.0f} tokens/s, {tflops:.3f} TFLOPS, "
          f"MFU {100 * tflops / peak_tflops:.2f}%, live {live:.1f} MiB, peak {peak:.1f} MiB")

#!/usr/bin/env python3
"""Reference values for zerotrain's lr schedules and fp16 loss scaler, computed by
DeepSpeed's own source code.

Provenance: DeepSpeed 0.19.8's source distribution from PyPI
(deepspeed-0.19.8.tar.gz, sha256 9e491abd0827ea5c389dd702e15e11e13d83d904bac4a20d6c2a4cb37207a9af).
The script runs two of its files unmodified, `deepspeed/runtime/lr_schedules.py` and
`deepspeed/runtime/fp16/loss_scaler.py`, and the pure functions
`estimate_zero2_model_states_mem_needs` and `estimate_zero3_model_states_mem_needs` lifted
verbatim (by `ast`) out of `deepspeed/runtime/zero/stage_1_and_2.py` and `stage3.py`. Importing DeepSpeed whole needs PyTorch and
compiled ops; these two files only need a few names from torch and from DeepSpeed's logging
and communication modules, which the script provides as small stand-ins (an optimizer
holding `param_groups`, rank 0, a logger): nothing the arithmetic depends on.

Usage (writes the JSON next to this script, which the Rust tests read):

    pip download deepspeed==0.19.8 --no-deps --no-binary :all: -d /tmp/ds
    python3 bench/reference/deepspeed_traces.py /tmp/ds/deepspeed-0.19.8.tar.gz
"""

import ast
import hashlib
import importlib.util
import json
import logging
import sys
import tarfile
import tempfile
import types
from pathlib import Path

SHA256 = "9e491abd0827ea5c389dd702e15e11e13d83d904bac4a20d6c2a4cb37207a9af"
ITERS = [-1, 0, 1, 2, 5, 9, 10, 15]


def stand_ins():
    """The names the two files import, and nothing else."""

    class Optimizer:
        def __init__(self, lr):
            self.param_groups = [{"lr": lr, "betas": (0.9, 0.999)}]

    torch = types.ModuleType("torch")
    torch.half = torch.float16 = "float16"
    torch.is_tensor = lambda _: False
    torch.optim = types.ModuleType("torch.optim")
    torch.optim.Optimizer = Optimizer
    deepspeed = types.ModuleType("deepspeed")
    comm = types.ModuleType("deepspeed.comm")
    comm.get_rank = lambda: 0
    deepspeed.comm = comm
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("deepspeed")
    utils.log_dist = lambda *args, **kwargs: None
    runtime = types.ModuleType("deepspeed.runtime")
    config_utils = types.ModuleType("deepspeed.runtime.config_utils")
    config_utils.DeepSpeedConfigObject = object
    runtime_utils = types.ModuleType("deepspeed.runtime.utils")
    runtime_utils.has_inf_or_nan = lambda _: False
    sys.modules.update({
        "torch": torch,
        "torch.optim": torch.optim,
        "deepspeed": deepspeed,
        "deepspeed.comm": comm,
        "deepspeed.utils": utils,
        "deepspeed.runtime": runtime,
        "deepspeed.runtime.config_utils": config_utils,
        "deepspeed.runtime.utils": runtime_utils,
    })
    return Optimizer


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def schedule_values(lr_schedules, Optimizer):
    """The lr each schedule leaves in the optimizer's param group (what the optimizer runs
    at) once `step(i)` has set last_batch_iteration to i (i = -1: as built)."""

    def at(make):
        values = []
        for i in ITERS:
            optimizer, scheduler = make()
            if i >= 0:
                scheduler.step(i)
            values.append(optimizer.param_groups[0]["lr"])
        return values

    def built(schedule, lr, **kwargs):
        def make():
            optimizer = Optimizer(lr)
            return optimizer, schedule(optimizer, **kwargs)
        return make

    one_cycle = dict(cycle_min_lr=0.1, cycle_max_lr=1.0, decay_lr_rate=0.5, cycle_first_step_size=4,
                     cycle_second_step_size=6, cycle_momentum=False)
    cases = {
        "warmup_log": built(lr_schedules.WarmupLR, 0.01, warmup_min_lr=1e-4, warmup_max_lr=1e-2,
                            warmup_num_steps=10, warmup_type="log"),
        "warmup_linear": built(lr_schedules.WarmupLR, 1.0, warmup_min_lr=0.0, warmup_max_lr=1.0,
                               warmup_num_steps=10, warmup_type="linear"),
        "warmup_decay": built(lr_schedules.WarmupDecayLR, 1.0, total_num_steps=12, warmup_min_lr=0.0,
                              warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear"),
        "warmup_cosine": built(lr_schedules.WarmupCosineLR, 0.5, total_num_steps=12, warmup_min_ratio=0.1,
                               warmup_num_steps=4, cos_min_ratio=0.01, warmup_type="linear"),
        "one_cycle_smooth": built(lr_schedules.OneCycle, 0.1, cycle_first_stair_count=0,
                                  cycle_second_stair_count=0, decay_step_size=2, **one_cycle),
        "one_cycle_stairs": built(lr_schedules.OneCycle, 0.1, cycle_first_stair_count=2,
                                  cycle_second_stair_count=3, decay_step_size=0, **one_cycle),
    }
    return {name: at(make) for name, make in cases.items()}


def scaler_traces(loss_scaler):
    """(scale after the update, hysteresis left) per update, for overflow patterns."""

    def run(power, window, hysteresis, consecutive, overflows, updates):
        s = loss_scaler.DynamicLossScaler(
            init_scale=2.0**power, scale_window=window, min_scale=1.0, delayed_shift=hysteresis,
            consecutive_hysteresis=consecutive)
        rows = []
        for update in range(updates):
            try:
                s.update_scale(update in overflows)
            except Exception as e:  # DeepSpeed raises at the minimum scale
                rows.append({"error": str(e)})
                break
            rows.append({"scale": s.cur_scale, "hysteresis": s.cur_hysteresis})
        return rows

    return {
        "golden": run(16, 4, 2, False, {4, 6, 7, 12, 15}, 16),
        "no_overflow": run(16, 4, 2, False, set(), 13),
        "consecutive": run(16, 1000, 2, True, {0, 2, 3}, 5),
        "not_consecutive": run(16, 1000, 2, False, {0, 2, 3}, 5),
        "at_minimum": run(2, 1000, 1, False, {0, 1, 2, 3}, 4),
    }


def lift(path, name):
    """The module-level function `name` of the file at `path`, run from its own source."""
    tree = ast.parse(path.read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = {}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(path), "exec"), scope)
    return scope[name]


def zero3_estimator_values(path):
    """DeepSpeed's ZeRO-3 model-state estimate (cpu bytes, gpu bytes) per case, for every
    combination of optimizer offload, parameter offload and zero_init."""
    estimate = lift(path, "estimate_zero3_model_states_mem_needs")
    cases = [(2_851_000_000, 100_000_000, 8, 1), (7_500_000_000, 250_000_003, 8, 8), (1_000_003, 4_099, 3, 2)]
    out = []
    for (p, largest, g, n) in cases:
        for (o, op) in ((False, False), (True, False), (True, True)):
            for zi in (False, True):
                cpu, gpu, _ = estimate(p, largest, g, n, o, op, zi, 1.5)
                out.append({"params": p, "largest_layer_params": largest, "gpus_per_node": g, "nodes": n,
                            "offload_optimizer": o, "offload_param": op, "zero_init": zi,
                            "cpu_bytes": cpu, "gpu_bytes": gpu})
    return out


def estimator_values(path):
    """DeepSpeed's ZeRO-2 model-state estimate (cpu bytes, gpu bytes) per case."""
    estimate = lift(path, "estimate_zero2_model_states_mem_needs")
    cases = [(2_851_000_000, 8, 1), (7_500_000_000, 8, 8), (1_000_003, 3, 2)]
    return [{"params": p, "gpus_per_node": g, "nodes": n, "offload": o,
             "cpu_bytes": estimate(p, g, n, o, 1.5)[0], "gpu_bytes": estimate(p, g, n, o, 1.5)[1]}
            for (p, g, n) in cases for o in (False, True)]


def main():
    logging.disable(logging.WARNING)  # "learning rate before it has started" at iteration -1
    archive = Path(sys.argv[1])
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SHA256:
        sys.exit(f"{archive}: sha256 {digest}, expected DeepSpeed 0.19.8's {SHA256}")
    Optimizer = stand_ins()
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            for member in ["deepspeed/runtime/lr_schedules.py", "deepspeed/runtime/fp16/loss_scaler.py",
                           "deepspeed/runtime/zero/stage_1_and_2.py", "deepspeed/runtime/zero/stage3.py"]:
                tar.extract(f"deepspeed-0.19.8/{member}", tmp, filter="data")
        root = Path(tmp) / "deepspeed-0.19.8"
        lr_schedules = load(root / "deepspeed/runtime/lr_schedules.py", "lr_schedules")
        loss_scaler = load(root / "deepspeed/runtime/fp16/loss_scaler.py", "loss_scaler")
        out = {
            "source": f"DeepSpeed 0.19.8 sdist, sha256 {SHA256}",
            "iterations": ITERS,
            "schedules": schedule_values(lr_schedules, Optimizer),
            "loss_scaler": scaler_traces(loss_scaler),
            "zero2_estimates": estimator_values(root / "deepspeed/runtime/zero/stage_1_and_2.py"),
            "zero3_estimates": zero3_estimator_values(root / "deepspeed/runtime/zero/stage3.py"),
        }
    target = Path(__file__).with_name("deepspeed_traces.json")
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()

"""NF4 (QLoRA's NormalFloat4, bitsandbytes' "nf4") in numpy: the fixture nf4.json the
engine's NF4 code is checked against.

    python3 bench/reference/nf4.py > bench/reference/nf4.json

A tensor is cut into blocks of 64 values along its flat order (the last may be shorter);
each block keeps its absmax (float32) and each value the index of the codebook level
nearest to value * (1 / absmax) (as bitsandbytes scales it, in float32); a value
dequantises to level * absmax. The nearest level is found by distance over all 16 levels
(argmin, float64), not by the midpoint tree the code under test uses. A block of zeros has
absmax 0 and its values dequantise to 0. The inputs: normal values of three scales, a
block of zeros, a partial last block of 37.
"""

import json

import numpy as np

# bitsandbytes' get_4bit_type("nf4"), as the QLoRA paper's code lists it.
LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
], dtype=np.float32)
BLOCK = 64


def main():
    rng = np.random.default_rng(2026)
    parts = [
        rng.normal(0.0, 0.02, 3 * BLOCK),
        rng.normal(0.0, 1.0, BLOCK),
        np.zeros(BLOCK),
        rng.normal(0.5, 3.0, 2 * BLOCK),
        rng.normal(0.0, 0.05, 37),
    ]
    values = np.concatenate(parts).astype(np.float32)
    absmax, codes, out = [], [], []
    for start in range(0, len(values), BLOCK):
        block = values[start:start + BLOCK]
        m = np.float32(np.abs(block).max())
        scale = np.float32(1.0) / m if m > 0 else np.float32(0.0)
        x = (block * scale).astype(np.float32)
        c = np.abs(x.astype(np.float64)[:, None] - LEVELS.astype(np.float64)[None, :]).argmin(axis=1)
        absmax.append(float(m))
        codes.extend(int(i) for i in c)
        out.extend(float(v) for v in (LEVELS[c] * m).astype(np.float32))
    fixture = {
        "levels": [float(v) for v in LEVELS],
        "values": [float(v) for v in values],
        "absmax": absmax,
        "codes": codes,
        "dequantized": out,
    }
    print(json.dumps(fixture))


if __name__ == "__main__":
    main()

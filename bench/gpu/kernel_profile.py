"""The costliest kernels of one step, from cubecl's own profiling log.

cubecl, with `[profiling.logger] level = "basic"` in a `cubecl.toml` of the working
directory, times every kernel it launches and, at each device sync, writes a table of the
kernels since the last one (name, total duration, launches, share). `zerotrain bench gpu`
syncs once at the end of each step and runs the engine's row last, so the log's last table
is the engine's last measured step. This prints that table's TOP costliest kernels with
their share of the step's kernel time, the step's kernel total, and whether the table before
it (the step before) launched as many kernels (a steady step).

Usage: python3 bench/gpu/kernel_profile.py LOG [TOP]
"""
import re
import sys


def tables(lines):
    """Each table as (rows, total): rows of (name, seconds, launches)."""
    out, rows, inside = [], [], False
    for line in lines:
        if line.startswith("| Name") and line.rstrip().endswith("|"):
            rows, inside = [], True
            continue
        if not inside or not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.rstrip().rstrip("|").split("|")[1:]]
        if len(cells) < 4:
            continue
        name, duration, launches = " | ".join(cells[:-3]), cells[-3], cells[-2]
        if name == "Total":
            out.append((rows, (seconds(duration), int(launches))))
            inside = False
        else:
            rows.append((re.sub(r"\s+", " ", name), seconds(duration), int(launches)))
    return out


def seconds(text):
    """A Rust `Duration` as `{:?}` prints it (`1.5ms`, `20.2s`, `310ns`, `4µs`)."""
    m = re.fullmatch(r"([0-9.]+)(ns|µs|us|ms|s)", text)
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    scale = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
    return float(m.group(1)) * scale


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) == 3 else 20
    with open(sys.argv[1], encoding="utf-8", errors="replace") as f:
        found = tables(f)
    if not found:
        sys.exit(f"{sys.argv[1]}: no profiling table (was cubecl's profiling on?)")
    rows, (total, launches) = found[-1]
    steady = len(found) > 1 and found[-2][1][1] == launches
    print(f"one step: {launches} kernel launches, {total * 1e3:.2f} ms of kernel time"
          f" ({'as many launches as the step before' if steady else 'the step before launched otherwise'})")
    print(f"{'share':>6} {'ms':>10} {'launches':>8}  kernel")
    for name, s, n in sorted(rows, key=lambda r: -r[1])[:top]:
        short = name if len(name) <= 110 else name[:24] + " ... " + name[-81:]
        print(f"{100 * s / max(total, 1e-12):5.1f}% {s * 1e3:10.3f} {n:8d}  {short}")


if __name__ == "__main__":
    main()

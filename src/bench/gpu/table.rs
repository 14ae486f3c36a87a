//! `bench gpu`'s table: its heading and one line per row.

use super::{GpuBench, GpuRow};

impl GpuBench {
    /// The table's heading: the model, the device and the columns.
    pub fn heading(&self) -> String {
        let mut out = format!(
            "{}, {} sequences per step, on {}; engine \
             in {} (stage and mode per row: one unit, units, units with recomputation, of the first N units only); medians of {} steps; MFU \
             against {} TFLOPS; phase times {}\n",
            self.model.describe(),
            self.batch,
            self.device.name(),
            self.precision,
            self.steps,
            self.peak_tflops,
            match self.breakdown {
                true => "synchronised: each waits for the device (--breakdown), the steps include the waits",
                false => "of the host queueing work (--breakdown splits the step)",
            }
        );
        out.push_str(
            "what                   step ms   tokens/s   TFLOPS    MFU  device MiB reserved  forward backward reduce  optim gather  \
             to/from device MiB\n",
        );
        out
    }

    /// One row of the table.
    pub fn line(r: &GpuRow) -> String {
        let mib = |b: Option<u64>| b.map_or("-".into(), |b| format!("{:.1}", b as f64 / (1 << 20) as f64));
        let phases = r.times.map_or(String::new(), |t| {
            let ms = |x: f64| x * 1e3;
            format!(
                "  {:>7.1} {:>8.1} {:>6.1} {:>6.1} {:>6.1}",
                ms(t.forward),
                ms(t.backward),
                ms(t.reduce),
                ms(t.optimizer),
                ms(t.gather)
            )
        });
        let crossed = r.host_device.map_or(String::new(), |c| {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            format!("  {:>8.1} / {:.1}", mib(c.to_device), mib(c.to_host))
        });
        format!(
            "{:<21} {:>8.1} {:>10.0} {:>8.3} {:>5.2}% {:>11} {:>8}{phases}{crossed}\n",
            r.what,
            r.step_seconds * 1e3,
            r.tokens_per_s,
            r.tflops,
            r.mfu * 100.0,
            mib(r.device_bytes),
            mib(r.device_reserved)
        )
    }
}

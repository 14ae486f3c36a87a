//! The run folder's `metrics.jsonl` (one line per optimizer step) and its PNG plot.

use std::io::{BufRead, LineWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One optimizer step, as written to `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Global step (1-based).
    pub step: u64,
    /// Mean training loss over the global batch.
    pub loss: f32,
    /// Learning rate the step used.
    pub lr: f64,
    /// Loss scale the step's gradients carried.
    pub loss_scale: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Training tokens per second over all ranks, this step.
    pub tokens_per_s: f64,
    /// The step was skipped (gradient overflow).
    pub skipped: bool,
    /// Validation loss, on steps where it was measured.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f32>,
    /// Fine-tuning sequences: the targets the step's loss counted over its whole global
    /// batch (its divisor); absent where every target counts.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub counted_tokens: Option<u64>,
    /// Bytes rank 0 moved in collectives this step (with replica groups, a round's included).
    #[serde(default)]
    pub comm_bytes: u64,
    /// Replica groups: rounds so far (`local_sgd`); absent without groups.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub rounds: Option<u64>,
    /// Replica groups through servers: the servers' round count the group's weights come
    /// from after its last round (`Round::global_round`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub global_round: Option<u64>,
    /// Replica groups: groups live at the last round (fewer than `local_sgd.groups` once
    /// the servers dropped some).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub live_groups: Option<usize>,
    /// Replica groups through async servers: rounds this group was ahead of the slowest
    /// live one at its last push.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub staleness: Option<u64>,
}

/// Appends lines to `metrics.jsonl`, each written through to the file as it is pushed.
///
/// Note: no kill loses history. A resumed run keeps the lines up to its checkpoint's step;
/// they are written to `metrics.jsonl.partial`, synced, and renamed over the old file, so
/// at every instant `metrics.jsonl` is the old history or the kept one, never a truncated
/// file. A kill mid-line leaves at most one unparsable last line, which the next open drops.
pub struct MetricsLog {
    path: PathBuf,
    file: LineWriter<std::fs::File>,
}

impl MetricsLog {
    /// Opens `<dir>/metrics.jsonl` for a run that starts after `first_step`: lines of later
    /// steps (left by a run that stopped after its last checkpoint) are dropped.
    pub fn open(dir: &Path, first_step: u64) -> std::io::Result<Self> {
        let path = dir.join("metrics.jsonl");
        let kept: Vec<String> = match std::fs::File::open(&path) {
            Ok(f) => std::io::BufReader::new(f)
                .lines()
                .map_while(Result::ok)
                .filter(|l| serde_json::from_str::<StepMetrics>(l).is_ok_and(|m| m.step <= first_step))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let partial = dir.join("metrics.jsonl.partial");
        let mut rewritten = std::fs::File::create(&partial)?;
        rewritten.write_all(kept.iter().flat_map(|l| [l.as_str(), "\n"]).collect::<String>().as_bytes())?;
        rewritten.sync_all()?;
        std::fs::rename(&partial, &path)?;
        let file = std::fs::OpenOptions::new().append(true).open(&path)?;
        Ok(Self { path, file: LineWriter::new(file) })
    }

    /// Appends one step; the line is in the file when this returns.
    pub fn push(&mut self, m: &StepMetrics) -> std::io::Result<()> {
        let line = serde_json::to_string(m).map_err(std::io::Error::other)?;
        writeln!(self.file, "{line}")
    }

    /// Flushes to disk.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }

    /// Every line written so far (this run's and the kept ones).
    pub fn read_all(&mut self) -> std::io::Result<Vec<StepMetrics>> {
        self.flush()?;
        let text = std::fs::read_to_string(&self.path)?;
        Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
    }
}

/// Draws training loss, validation loss and learning rate over the steps to `out` (PNG).
/// Text needs a TrueType font: the first of a few common system paths that exists; without
/// one the plot is drawn without labels.
pub fn plot(metrics: &[StepMetrics], out: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let font = register_font();
    let root = BitMapBackend::new(out, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let last = metrics.last().map_or(1, |m| m.step).max(1);
    let losses: Vec<(u64, f32)> = metrics.iter().filter(|m| m.loss.is_finite()).map(|m| (m.step, m.loss)).collect();
    let vals: Vec<(u64, f32)> = metrics.iter().filter_map(|m| m.val_loss.map(|v| (m.step, v))).collect();
    let top = losses.iter().chain(&vals).map(|(_, l)| *l).fold(0.0f32, f32::max).max(1e-3) * 1.05;
    let lr_top = metrics.iter().map(|m| m.lr).fold(0.0f64, f64::max).max(1e-12) * 1.1;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(16);
    if font {
        builder
            .caption("zerotrain: loss and learning rate", ("sans-serif", 22))
            .x_label_area_size(36)
            .y_label_area_size(56)
            .right_y_label_area_size(64);
    }
    let mut chart = builder
        .build_cartesian_2d(0u64..last, 0f32..top)
        .map_err(|e| e.to_string())?
        .set_secondary_coord(0u64..last, 0f64..lr_top);
    if font {
        chart.configure_mesh().x_desc("step").y_desc("loss (nats/token)").draw().map_err(|e| e.to_string())?;
        chart.configure_secondary_axes().y_desc("learning rate").draw().map_err(|e| e.to_string())?;
    }
    // Training loss, smoothed with an exponential moving average.
    let mut ema = None;
    let smooth: Vec<(u64, f32)> = losses
        .iter()
        .map(|&(s, l)| {
            let e = ema.map_or(l, |e: f32| 0.9 * e + 0.1 * l);
            ema = Some(e);
            (s, e)
        })
        .collect();
    let series = chart.draw_series(LineSeries::new(smooth, BLUE.stroke_width(2))).map_err(|e| e.to_string())?;
    if font {
        series.label("train loss (EMA)").legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE));
    }
    let series =
        chart.draw_series(LineSeries::new(vals, RED.stroke_width(2)).point_size(4)).map_err(|e| e.to_string())?;
    if font {
        series.label("validation loss").legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RED));
    }
    let lr_points = metrics.iter().map(|m| (m.step, m.lr));
    let series = chart.draw_secondary_series(LineSeries::new(lr_points, GREEN.mix(0.7))).map_err(|e| e.to_string())?;
    if font {
        series.label("learning rate").legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], GREEN));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| format!("{}: {e}", out.display()))
}

/// Registers a system TrueType font as "sans-serif" once; whether one was found.
pub fn register_font() -> bool {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FOUND.get_or_init(|| {
        const CANDIDATES: [&str; 4] = [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/System/Library/Fonts/Supplemental/Arial.ttf",
        ];
        CANDIDATES.iter().filter_map(|p| std::fs::read(p).ok()).any(|bytes| {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes).is_ok()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64) -> StepMetrics {
        StepMetrics {
            step,
            loss: 1.0 / step as f32,
            lr: 1e-3,
            loss_scale: 1.0,
            grad_norm: 0.5,
            tokens_per_s: 1e4,
            skipped: false,
            val_loss: None,
            counted_tokens: None,
            comm_bytes: 0,
            rounds: None,
            live_groups: None,
            global_round: None,
            staleness: None,
        }
    }

    fn steps_in(path: &Path) -> Vec<u64> {
        let text = std::fs::read_to_string(path).unwrap();
        text.lines().map(|l| serde_json::from_str::<StepMetrics>(l).unwrap().step).collect()
    }

    /// Regression: opening truncated the file and held the kept lines in an unflushed
    /// buffer, so a kill during a resumed run left 0 bytes of a 20-step history.
    #[test]
    fn the_history_survives_a_kill_at_any_point_of_a_resumed_run() {
        let dir = std::env::temp_dir().join(format!("zerotrain-metrics-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        let mut log = MetricsLog::open(&dir, 0).unwrap();
        (1..=20).for_each(|s| log.push(&step(s)).unwrap());
        std::mem::forget(log); // killed: no destructor, no flush
        assert_eq!(steps_in(&path), (1..=20).collect::<Vec<_>>());

        // Resumed from the checkpoint at step 12, then killed at once, then after 2 steps.
        let log = MetricsLog::open(&dir, 12).unwrap();
        std::mem::forget(log);
        assert_eq!(steps_in(&path), (1..=12).collect::<Vec<_>>());
        let mut log = MetricsLog::open(&dir, 12).unwrap();
        log.push(&step(13)).unwrap();
        log.push(&step(14)).unwrap();
        std::mem::forget(log);
        assert_eq!(steps_in(&path), (1..=14).collect::<Vec<_>>());

        // A kill mid-line: the torn line is dropped at the next open, the rest kept.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"step\": 15, \"lo").unwrap();
        let log = MetricsLog::open(&dir, 20).unwrap();
        drop(log);
        assert_eq!(steps_in(&path), (1..=14).collect::<Vec<_>>());
        assert!(!dir.join("metrics.jsonl.partial").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

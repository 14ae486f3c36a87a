//! A unit longer than one device reduction may be: Burn 0.22's reductions on lavapipe sum
//! only the first 262,132 elements of a 1-D tensor of 2^18 or more (`sum`, `sum_dim`, `mean`
//! alike; measured: lavapipe's compiler ends a shader's loops after 65,535 iterations, and
//! a reduction reads 4 elements per iteration), and a GPT-2 block alone has 7 million. The engine sums a unit's
//! squared gradients on the device for the norm, which clipping and the overflow check read,
//! so a norm missing most of a unit would clip to the wrong length and step on an infinite
//! gradient. One parameter of `LEN` elements, one rank, the states on the device.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, TensorData};
use zerotrain::{Engine, Error, launch};
use zerotrain_models::cross_entropy;

use super::{DEVICE_LOSS_TOL, Gpu, device_alone, on_device};
use crate::common::*;
use crate::units::Tokens;

/// Elements of the parameter: twice the length past which lavapipe's sums stop counting.
const LEN: usize = 600_000;

/// One parameter, whose loss is its dot product with a constant: the gradient is that
/// constant, exactly, whatever the device.
#[derive(Module, Debug)]
struct Wide {
    w: Param<Tensor<1>>,
}

impl Wide {
    fn loss(&self, constant: &[f32]) -> Tensor<1> {
        let w = self.w.val();
        let c = Tensor::<1>::from_data(TensorData::new(constant.to_vec(), [constant.len()]), (&w.device(), w.dtype()));
        (w * c).sum()
    }
}

fn zeros() -> Wide {
    fresh(|d: &Device| Wide { w: Param::from_tensor(Tensor::zeros([LEN], d)) })
}

/// The gradient each test sets: small values, all of them different from zero.
fn gradient() -> Vec<f32> {
    (0..LEN).map(|i| ((i % 13) as f32 - 6.5) * 1e-3).collect()
}

/// One step of `json`'s engine on `on` with the loss above: the reported gradient norm,
/// whether the step was skipped, and the parameter after it.
fn one_step(json: &str, on: Gpu, constant: &[f32]) -> (f32, bool, Vec<f32>) {
    let plan = plan(&on_device(json, on), 1);
    launch(&plan, |ctx| {
        let mut engine = Engine::new(zeros(), &plan, &ctx)?;
        let loss = engine.forward(|m| m.loss(constant))?;
        engine.backward(loss)?;
        let report = engine.step()?.expect("accumulation 1");
        let w = params_by_path(&engine.full_model()?).remove(0).1;
        Ok::<_, Error>((report.grad_norm, report.skipped, w))
    })
    .unwrap()
    .remove(0)
}

/// The norm the device reports for a unit of `LEN` elements is the gradient's, computed
/// here in f64 from the values the test chose, at stages 0 and 3 (within f32's rounding of
/// 600,000 squares); and with clipping on, the step moves the parameter by what AdamW's
/// first step makes of the clipped gradient: lr in each element's sign, every element.
pub fn a_large_units_norm_counts_every_element(on: Gpu) {
    let _alone = device_alone();
    let g = gradient();
    let want = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    for stage in [0u8, 3] {
        let json = recipe(stage, 1, 1, 0.5);
        let (norm, skipped, w) = one_step(&json, on, &g);
        let what = format!("{} stage {stage}", on.name);
        assert!(!skipped, "{what}: skipped");
        let apart = (f64::from(norm) - want).abs() / want;
        assert!(apart <= 1e-5, "{what}: norm {norm} against {want} ({apart:.1e} relative)");
        // AdamW's first step is lr * sign(g) (bias-corrected moments of one gradient; eps
        // aside), clipped or not: every element must have moved, the last ones too.
        let lr = recipe_lr(0) as f32;
        let worst = w.iter().zip(&g).map(|(&w, &g)| (w + lr * g.signum()).abs()).fold(0f32, f32::max);
        assert!(worst <= lr * 1e-3, "{what}: an element moved {worst} away from -lr * sign(g)");
    }
}

/// fp16: an infinite gradient only in the last elements of a long unit (the constant is
/// 1000 there; times the loss scale 256, past fp16's largest value) is an overflow: the
/// step is skipped and the parameter stays zero.
pub fn an_overflow_at_the_end_of_a_large_unit_skips_the_step(on: Gpu) {
    let _alone = device_alone();
    let mut g = gradient();
    for x in &mut g[LEN - 4..] {
        *x = 1000.0;
    }
    let fp16 = r#"{ "fp16": {"enabled": true, "initial_scale_power": 8},"#;
    for stage in [0u8, 3] {
        let json = recipe(stage, 1, 1, 0.0).replacen('{', fp16, 1);
        let (norm, skipped, w) = one_step(&json, on, &g);
        let what = format!("{} stage {stage}", on.name);
        assert!(skipped && !norm.is_finite(), "{what}: the overflow went unseen (norm {norm}, skipped {skipped})");
        assert!(w.iter().all(|&x| x == 0.0), "{what}: the skipped step changed the parameter");
    }
}

/// `zerotrain::reduce` on the device counts every element: sums of small integers (exact
/// in f32 whatever the order) and their means, up to 2 million elements; and the language
/// models' loss, a mean over 270,000 sequences of one prediction, equals the same loss of
/// the same logits on the CPU.
pub fn long_reductions_count_every_element(on: Gpu) {
    let _alone = device_alone();
    let device = (on.device)();
    for n in [1_000usize, 300_000, 2_000_000] {
        let values: Vec<f32> = (0..n).map(|i| (i % 5) as f32).collect();
        let want = values.iter().map(|&v| f64::from(v)).sum::<f64>();
        let t = Tensor::<1>::from_data(TensorData::new(values, [n]), &device);
        let sum = zerotrain::reduce::sum(t.clone()).into_scalar::<f32>();
        assert_eq!(f64::from(sum), want, "{}: sum of {n}", on.name);
        let mean = f64::from(zerotrain::reduce::mean(t).into_scalar::<f32>());
        assert!((mean - want / n as f64).abs() <= 1e-6 * want / n as f64, "{}: mean of {n}: {mean}", on.name);
    }
    let (sequences, vocab) = (270_000, 11);
    let w = Tokens { vocab, len: 2 };
    let logits: Vec<f32> = (0..sequences * vocab).map(|i| ((i * 37) % 101) as f32 / 25.0 - 2.0).collect();
    let loss = |device: &Device| {
        let logits = Tensor::<3>::from_data(TensorData::new(logits.clone(), [sequences, 1, vocab]), device);
        cross_entropy(logits, &w.tokens(0..sequences as u64, device)).into_scalar::<f32>()
    };
    let (gpu, cpu) = (loss(&device), loss(&Device::flex()));
    assert!(
        (gpu - cpu).abs() <= DEVICE_LOSS_TOL * cpu,
        "{}: loss over 270,000 predictions {gpu}, on the CPU {cpu}",
        on.name
    );
}

/// A parameter of 144 MiB, past the largest buffer lavapipe allocates (128 MiB): on a device
/// that cannot hold it (`too_big`) the engine's step is an error naming the parameter it was
/// reading and the allocation, from `launch`, not a panic; on one that can, the step runs.
pub fn a_tensor_past_the_devices_largest_buffer_is_an_error_not_a_panic(on: Gpu, too_big: bool) {
    let _alone = device_alone();
    let len = 36 * 1024 * 1024;
    let model = fresh(|d: &Device| Wide { w: Param::from_tensor(Tensor::zeros([len], d)) });
    let plan = plan(&on_device(&recipe(0, 1, 1, 0.0), on), 1);
    let constant = vec![1e-3f32; len];
    let outcome = launch(&plan, |ctx| {
        let mut engine = Engine::new(model.clone(), &plan, &ctx)?;
        let loss = engine.forward(|m| m.loss(&constant))?;
        engine.backward(loss)?;
        Ok::<_, Error>(engine.step()?.is_some())
    });
    if !too_big {
        assert!(outcome.expect("the device holds 144 MiB")[0], "{}: no step", on.name);
        return;
    }
    let err = outcome.expect_err("lavapipe allocated 144 MiB").to_string();
    assert!(!err.contains("panicked"), "{}: {err}", on.name);
    assert!(err.contains("the device failed while reading") && err.contains("can't allocate buffer"), "{err}");
    assert!(err.contains("max_storage_buffer_binding_size"), "{err}");
}

//! What `zerotrain train` prints of the trained model.

use zerotrain::Plan;
use zerotrain::config::Tier;
use zerotrain_models::data::Corpus;
use zerotrain_models::{CausalLm, Gpt, GptConfig, Sampling};
use zerotrain_zero::ZeroStage;

/// Whether `zerotrain train` writes samples of the trained model at its end (`--samples`).
/// Writing them gathers the whole model on rank 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SampleMode {
    /// Unless the config keeps the model from ever being whole in memory (`samples::withheld`).
    #[default]
    Auto,
    /// Always, whatever the model's size.
    On,
    /// Never.
    Off,
}

/// Why a run writes no samples, if it writes none: asked not to, or (`Auto`) its
/// parameters are partitioned at stage 3 and kept out of memory (`offload_param`) or stored
/// as NF4, where gathering the whole model on rank 0 would undo what the config asked for
/// (a 1.1B base gathered for samples takes twice the memory the run trains in). Every rank
/// decides alike from the plan, so all take part in the gather or none does.
pub(super) fn withheld(plan: &Plan, mode: SampleMode) -> Option<String> {
    match mode {
        SampleMode::On => None,
        SampleMode::Off => Some("--samples off".into()),
        SampleMode::Auto => {
            let offloaded = match &plan.zero.offload.param {
                Tier::Device => None,
                Tier::Host => Some("the parameters' shards in host memory (offload_param)"),
                Tier::Nvme(_) => Some("the parameters' shards on NVMe (offload_param)"),
            };
            let nf4 = plan.lora.as_ref().is_some_and(|lora| lora.quantize.is_some());
            let kept_out = offloaded.or(nf4.then_some("the frozen base's shards in NF4 (zerotrain.lora.quantize)"));
            kept_out.filter(|_| plan.zero.stage == ZeroStage::Parameters).map(|why| {
                format!("stage 3 keeps {why}, and samples would gather the whole model on rank 0 (`--samples on` writes them)")
            })
        }
    }
}

/// Text from the trained model: for the arithmetic corpus, completions of held-out sums
/// (checked); for other text, a sampled continuation of the validation text.
pub(super) fn write_samples(model: &Gpt, corpus: &Corpus, shape: &GptConfig) -> zerotrain::Result<Vec<String>> {
    let mut rng = 0x5EED;
    if corpus.name == "generated arithmetic" {
        let text = corpus.decode(&corpus.valid);
        return text
            .lines()
            .skip(1)
            .take(8)
            .map(|line| {
                let prompt = &line[..line.find('=').map_or(line.len(), |i| i + 1)];
                let context = format!("\n{prompt}");
                let out =
                    model.generate(&corpus.encode(&context), 4, shape.block_size, Sampling::GREEDY, &[], &mut rng)?;
                let answer: String = corpus.decode(&out).chars().take_while(|c| *c != '\n').collect();
                let verdict = if format!("{prompt}{answer}") == line { "correct" } else { "wrong" };
                Ok(format!("{prompt}{answer}  ({verdict}; expected {line})"))
            })
            .collect();
    }
    let prompt: Vec<u32> = corpus.valid.iter().take(shape.block_size / 2).copied().collect();
    let out = model.generate(&prompt, 200, shape.block_size, Sampling::top_k(0.8, 0), &[], &mut rng)?;
    Ok(vec![format!("{}|{}", corpus.decode(&prompt), corpus.decode(&out))])
}

#[cfg(test)]
mod tests {
    use super::{SampleMode, withheld};
    use zerotrain::config::{Config, Overrides};

    fn plan(zero: &str, zerotrain: &str) -> zerotrain::Plan {
        let json = format!(
            r#"{{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{{zero}}}, "zerotrain": {{"world_size": 2{zerotrain}}}}}"#
        );
        let config = Config::parse(&json, "test.json").unwrap();
        config.resolve(Overrides::default()).unwrap()
    }

    /// `auto` withholds the samples exactly where stage 3 keeps the parameters out of
    /// memory or the base in NF4; the optimizer's offload alone, or a lower stage, does not;
    /// `on` and `off` rule over the config.
    #[test]
    fn auto_withholds_samples_only_where_the_model_is_never_whole() {
        let nvme = r#""offload_param": {"device": "nvme", "nvme_path": "/tmp/x"}"#;
        let cpu = r#""offload_param": {"device": "cpu"}"#;
        let optimizer = r#""offload_optimizer": {"device": "cpu"}"#;
        let nf4 = r#", "lora": {"r": 2, "quantize": "nf4"}"#;
        let lora = r#", "lora": {"r": 2}"#;
        let written = [
            plan(r#""stage": 2"#, ""),
            plan(&format!(r#""stage": 2, {optimizer}"#), ""),
            plan(r#""stage": 3"#, ""),
            plan(&format!(r#""stage": 3, {optimizer}"#), ""),
            plan(r#""stage": 3"#, lora),
        ];
        for p in &written {
            assert_eq!(withheld(p, SampleMode::Auto), None, "{:?}", p.zero);
            assert!(withheld(p, SampleMode::Off).is_some_and(|why| why.contains("--samples off")));
        }
        let kept_out = [
            (plan(&format!(r#""stage": 3, {nvme}"#), ""), "on NVMe (offload_param)"),
            (plan(&format!(r#""stage": 3, {cpu}"#), ""), "in host memory (offload_param)"),
            (plan(r#""stage": 3"#, nf4), "in NF4 (zerotrain.lora.quantize)"),
        ];
        for (p, why) in &kept_out {
            let said = withheld(p, SampleMode::Auto).unwrap_or_default();
            assert!(said.contains(why) && said.contains("--samples on"), "{said}");
            assert_eq!(withheld(p, SampleMode::On), None);
        }
    }
}

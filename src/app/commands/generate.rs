//! `zerotrain generate`: text sampled from a Hugging Face family's model (`model.hf_dir`,
//! or a checkpoint of it), one rank on the config's device, deterministic for a seed.

use std::path::PathBuf;

use anyhow::bail;
use burn::tensor::Device;

use crate::app::family::WithModel;
use crate::app::family::load::load_model;
use crate::app::keys;
use crate::app::models::{CausalLm, Sampling};
use crate::{LoadOptions, Overrides, Plan};

/// What `zerotrain generate` was asked.
#[derive(Debug, Clone)]
pub struct GenerateArgs {
    pub config: PathBuf,
    pub prompt: String,
    /// Tokens to add.
    pub tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    pub checkpoint: Option<PathBuf>,
    pub tag: Option<String>,
    /// Print JSON (`text`, `prompt_ids`, `ids`) instead of the text.
    pub json: bool,
}

/// `zerotrain generate`: prints the prompt and its continuation.
pub fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    if !(args.sampling.temperature >= 0.0 && args.sampling.temperature.is_finite()) {
        bail!("--temperature must be 0 (greedy) or positive, not {}", args.sampling.temperature);
    }
    let overrides = Overrides { world_size: Some(1), total_steps: Some(1), ..Overrides::default() };
    let (mut plan, settings) = keys::load(&args.config, overrides)?;
    plan.pipeline = None;
    let device = Device::flex().autodiff();
    device.seed(plan.runtime.seed);
    let loaded = load_model(&settings, &args.config, &device, args.checkpoint.as_deref())?;
    let prompt = loaded.tokenizer.encode_prompt(&args.prompt)?;
    if prompt.is_empty() {
        bail!("--prompt is empty: give at least one token of text to continue");
    }
    let job = Generate { plan: &plan, args: &args, prompt: &prompt, context: loaded.context };
    let out = loaded.model.run(job)?;
    let text = format!("{}{}", args.prompt, loaded.tokenizer.decode(&out)?);
    if args.json {
        println!("{}", serde_json::json!({"text": text, "prompt_ids": prompt, "ids": out}));
    } else {
        println!("{text}");
    }
    Ok(())
}

struct Generate<'a> {
    plan: &'a Plan,
    args: &'a GenerateArgs,
    prompt: &'a [u32],
    context: usize,
}

impl WithModel for Generate<'_> {
    type Output = anyhow::Result<Vec<u32>>;

    /// The model as the engine holds it on one rank (the config's device and compute dtype,
    /// gathered whole at stage 3), with a checkpoint's weights where one is given.
    fn run<M: CausalLm>(self, model: M) -> anyhow::Result<Vec<u32>> {
        let model = crate::app::train::Handout::new(model, self.plan);
        let tokens = crate::launch(self.plan, |ctx| -> crate::Result<Option<Vec<u32>>> {
            let mut engine = crate::trainer(model.take(), self.plan, &ctx)?;
            if let Some(dir) = &self.args.checkpoint {
                engine.load_checkpoint(dir, self.args.tag.as_deref(), LoadOptions::module_only())?;
            }
            let Some(model) = engine.gather_model(0)? else { return Ok(None) };
            drop(engine);
            let mut rng = self.args.seed;
            model.generate(self.prompt, self.args.tokens, self.context, self.args.sampling, &mut rng).map(Some)
        })?;
        Ok(tokens.into_iter().flatten().next().expect("rank 0 generates"))
    }
}

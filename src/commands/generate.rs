//! `zerotrain generate`: text sampled from a Hugging Face family's model (`model.hf_dir`,
//! or a checkpoint of it), one rank on the config's device, deterministic for a seed.

use std::path::{Path, PathBuf};

use anyhow::bail;
use burn::tensor::Device;
use serde_json::Value;

use crate::keys;
use zerotrain::{LoadOptions, Overrides, Plan};
use zerotrain_models::family::load::{LoadedModel, load_model};
use zerotrain_models::family::{WithModel, companions};
use zerotrain_models::file_error::{FileError, read_optional_json};
use zerotrain_models::hf;
use zerotrain_models::{CausalLm, Sampling};

/// What `zerotrain generate` was asked.
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateArgs {
    /// A config whose `model` section names the model (text is generated over the model's
    /// own positions).
    #[arg(long)]
    pub config: PathBuf,
    /// The text to continue (with --chat: the user's turn).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Chat: render a conversation through the tokenizer's chat template with the
    /// generation prompt (`--prompt` as one user turn, or `--messages`) and print the
    /// assistant's answer alone.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: the conversation so far, a JSON file of a list of `{role, content}`
    /// (or an object holding one as `messages`).
    #[arg(long, value_name = "FILE")]
    pub messages: Option<PathBuf>,
    /// With --chat: the chat template (a Jinja file) instead of the tokenizer's own.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Tokens to add (at most 16,777,216).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(0..=1 << 24))]
    pub tokens: u32,
    /// 0: the most likely token each time; else the sampling temperature.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Sample among the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Then among the fewest most likely whose probabilities reach P (nucleus
    /// sampling; 1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// The sampler's seed (the same seed gives the same text).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A checkpoint folder (holding `latest` and the tags) of the model to load.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// The checkpoint's tag (default: the one `latest` names).
    #[arg(long)]
    pub tag: Option<String>,
    /// A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`): the
    /// model gets its adapters, from its values (its config rules over `zerotrain.lora`).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Print JSON: the text, and the token ids of the prompt and of what was added.
    #[arg(long)]
    pub json: bool,
    /// Add all --tokens, past the model's end tokens (by default sampling stops after
    /// one: generation_config.json's eos_token_id, else config.json's, else the
    /// tokenizer's end token).
    #[arg(long)]
    pub ignore_eos: bool,
}

impl GenerateArgs {
    /// How each token is picked.
    pub fn sampling(&self) -> Sampling {
        Sampling { temperature: self.temperature, top_k: self.top_k, top_p: self.top_p }
    }
}

/// `zerotrain generate`: prints the prompt and its continuation.
pub fn generate(mut args: GenerateArgs) -> anyhow::Result<()> {
    args.checkpoint =
        args.checkpoint.as_deref().map(|d| companions::checked_folder(d, args.tag.as_deref())).transpose()?;
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be 0 (greedy) or positive, not {}", args.temperature);
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be above 0 and at most 1, not {}", args.top_p);
    }
    let overrides = Overrides { total_steps: Some(1), ..Overrides::default() };
    let (plan, settings) = keys::load_for_one_rank(&args.config, overrides)?;
    let device = Device::flex().autodiff();
    device.seed(plan.runtime.seed);
    let loaded = load_model(
        &settings.hf_model(&args.config, keys::adapters(&plan, args.adapter.as_deref())?)?,
        &args.config,
        &device,
        args.checkpoint.as_deref(),
        plan.runtime.seed,
    )?;
    let params = zerotrain_models::hf::size::ModelSize::of(&loaded.config).params;
    crate::train::memory::check_inference_memory(&plan, params, "generate")?;
    if !args.chat && (args.messages.is_some() || args.chat_template.is_some()) {
        bail!("--messages and --chat-template are for --chat");
    }
    let rendered = match args.chat {
        true => Some(chat_prompt(&args, &loaded)?),
        false => None,
    };
    let prompt = match (&rendered, &args.prompt) {
        (Some(text), _) => loaded.tokenizer.encode_with_char_offsets(text)?.0,
        (None, Some(text)) => loaded.tokenizer.encode_prompt(text)?,
        (None, None) => bail!("give --prompt TEXT to continue (or --chat with --prompt or --messages)"),
    };
    if prompt.is_empty() {
        bail!("--prompt is empty: give at least one token of text to continue");
    }
    let stop = if args.ignore_eos { Vec::new() } else { stop_tokens(&loaded, args.checkpoint.as_deref())? };
    // The model's own positions, as `transformers` generates (model.block_size is the
    // context a run trains at, not a limit of the model's).
    let (context, bound) = loaded.config.exact_context();
    if prompt.len() > context {
        bail!("--prompt is {} tokens, more than {bound}: give a shorter prompt (nothing of it was cut)", prompt.len());
    }
    if prompt.len() + args.tokens as usize > context {
        eprintln!(
            "warning: {} tokens after a prompt of {} pass {bound}: from token {} on, each is predicted from the \
             last {context} only",
            args.tokens,
            prompt.len(),
            context - prompt.len() + 1
        );
    }
    let job = Generate { plan: &plan, args: &args, prompt: &prompt, stop: &stop, context };
    let out = loaded.model.run(job)?;
    let tokenless: std::collections::BTreeSet<u32> =
        out.iter().copied().filter(|&id| !loaded.tokenizer.has_token(id)).collect();
    if !tokenless.is_empty() {
        eprintln!(
            "warning: the model generated {} that {} has no token for ({:?}: its vocabulary of {} is padded past the \
             tokenizer's {} ids), which decode as nothing; the JSON output's ids list them",
            super::count(tokenless.len(), "id"),
            loaded.tokenizer.file().display(),
            tokenless,
            loaded.config.vocab_size(),
            loaded.tokenizer.id_bound()
        );
    }
    let text = match &rendered {
        // The answer alone, without the end token it stopped at.
        Some(_) => {
            let answer = match out.split_last() {
                Some((last, answer)) if stop.contains(last) => answer,
                _ => &out[..],
            };
            loaded.tokenizer.decode(answer)?
        }
        None => {
            format!("{}{}", args.prompt.as_deref().unwrap_or(""), loaded.tokenizer.decode_continuation(&prompt, &out)?)
        }
    };
    if args.json {
        let mut json = serde_json::json!({"text": text, "prompt_ids": prompt, "ids": out, "context": context});
        if let Some(rendered) = &rendered {
            json["prompt"] = rendered.clone().into();
        }
        println!("{json}");
    } else {
        println!("{text}");
    }
    Ok(())
}

/// `--chat`'s prompt: the conversation (`--messages`, or `--prompt` as one user turn)
/// rendered by the chat template with the generation prompt, as
/// `apply_chat_template(add_generation_prompt=True)` renders it.
fn chat_prompt(args: &GenerateArgs, loaded: &LoadedModel) -> anyhow::Result<String> {
    use zerotrain_models::text::finetune::ChatTemplate;
    let messages = match (&args.messages, &args.prompt) {
        (Some(file), None) => {
            let json = read_optional_json(file)?
                .ok_or_else(|| anyhow::anyhow!("--messages {}: no such file", file.display()))?;
            let list = json.get("messages").cloned().unwrap_or(json);
            if !list.as_array().is_some_and(|l| !l.is_empty() && l.iter().all(|m| m["role"].is_string())) {
                bail!("--messages {}: not a list of messages, each with a role and a content", file.display());
            }
            list
        }
        (None, Some(text)) => serde_json::json!([{"role": "user", "content": text}]),
        (Some(_), Some(_)) => bail!("--chat takes --prompt (one user turn) or --messages FILE, not both"),
        (None, None) => bail!("--chat needs --prompt TEXT (one user turn) or --messages FILE"),
    };
    let template = ChatTemplate::for_tokenizer(loaded.tokenizer.file(), args.chat_template.as_deref())?;
    let rendered = template
        .render(&messages, None, true, &Default::default())
        .map_err(|e| anyhow::anyhow!("{}: {e}", template.origin()))?;
    Ok(rendered.text)
}

/// The tokens sampling stops after, as `transformers`' `generate` takes them: the
/// `eos_token_id` (one id or a list) of the `generation_config.json` beside the checkpoint
/// (or else the model), else of the model's `config.json`, else the tokenizer's end token.
fn stop_tokens(loaded: &LoadedModel, checkpoint: Option<&Path>) -> anyhow::Result<Vec<u32>> {
    for dir in [checkpoint, loaded.folder()].into_iter().flatten() {
        let path = dir.join(hf::GENERATION_CONFIG_FILE);
        if let Some(json) = read_optional_json(&path)? {
            if let Some(ids) = eos_ids(&json).map_err(|e| FileError::new(&path, e))? {
                return Ok(ids);
            }
            break;
        }
    }
    if let Some(ids) = eos_ids(&loaded.config.json).map_err(|e| FileError::new(&loaded.config_file(), e))? {
        return Ok(ids);
    }
    Ok(vec![loaded.tokenizer.end_of_text()?.0])
}

/// A JSON object's `eos_token_id`: one id or a list of them; `None` where absent or null.
fn eos_ids(json: &Value) -> Result<Option<Vec<u32>>, String> {
    let id = |v: &Value| v.as_u64().and_then(|i| u32::try_from(i).ok());
    let ids = match json.get("eos_token_id") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) => list.iter().map(id).collect::<Option<Vec<u32>>>(),
        Some(one) => id(one).map(|i| vec![i]),
    };
    ids.map(Some)
        .ok_or_else(|| format!("eos_token_id must be a token id or a list of them, not {}", json["eos_token_id"]))
}

struct Generate<'a> {
    plan: &'a Plan,
    args: &'a GenerateArgs,
    prompt: &'a [u32],
    stop: &'a [u32],
    context: usize,
}

impl WithModel for Generate<'_> {
    type Output = anyhow::Result<Vec<u32>>;

    /// The model as the engine holds it on one rank (the config's device and compute dtype,
    /// gathered whole at stage 3), with a checkpoint's weights where one is given.
    fn run<M: CausalLm>(self, model: M) -> anyhow::Result<Vec<u32>> {
        let model = crate::train::Handout::new(model, self.plan);
        let tokens = zerotrain::launch(self.plan, |ctx| -> zerotrain::Result<Option<Vec<u32>>> {
            let mut engine = zerotrain::trainer(model.take(), self.plan, &ctx)?;
            if let Some(dir) = &self.args.checkpoint {
                engine.load_checkpoint(dir, self.args.tag.as_deref(), LoadOptions::module_only())?;
            }
            let Some(model) = engine.gather_model(0)? else { return Ok(None) };
            drop(engine);
            let mut rng = self.args.seed;
            let (count, sampling) = (self.args.tokens as usize, self.args.sampling());
            model.generate(self.prompt, count, self.context, sampling, self.stop, &mut rng).map(Some)
        })?;
        Ok(tokens.into_iter().flatten().next().expect("rank 0 generates"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn end_tokens_are_one_id_or_a_list() {
        assert_eq!(eos_ids(&json!({"eos_token_id": 7})), Ok(Some(vec![7])));
        assert_eq!(eos_ids(&json!({"eos_token_id": [128001, 128009]})), Ok(Some(vec![128001, 128009])));
        assert_eq!(eos_ids(&json!({"eos_token_id": null})), Ok(None));
        assert_eq!(eos_ids(&json!({"bos_token_id": 1})), Ok(None));
        for bad in [json!("</s>"), json!([1, "x"]), json!(-1), json!(1u64 << 40)] {
            let err = eos_ids(&json!({"eos_token_id": bad})).unwrap_err();
            assert!(err.starts_with("eos_token_id must be a token id or a list of them"), "{err}");
        }
    }
}

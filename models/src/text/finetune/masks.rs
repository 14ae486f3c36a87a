//! A row's tokens and which of them the loss is on (`tokenize --loss-on`).
//!
//! # Note: whose rules
//! - A conversation is rendered by the chat template and tokenized without the special
//!   tokens the tokenizer adds around a text (the template writes its own), as
//!   `apply_chat_template(tokenize=True)` does; no end token follows (the template closes
//!   the conversation, as TRL leaves it). The assistant's tokens are transformers' assistant
//!   mask: for each `{% generation %}` span, the tokens from the one holding its first
//!   character to the one holding its last (to the end where that is past the text).
//! - A prompt/completion row is TRL's: strings are tokenized as `tokenizer(text)` does, the
//!   completion closed by the end token's text where it does not end with it; messages are
//!   rendered, the prompt alone with the generation prompt. The completion is what follows
//!   the longest common prefix of the prompt's tokens and the whole row's (TRL's
//!   `common_prefix_length`: a template may render the prompt alone differently).
//! - A plain `text` row is a document, every token trained on, closed by the end token as
//!   `tokenize` closes documents.

use super::rows::{Part, Row};
use super::template::{ChatTemplate, Rendered};
use crate::text::Tokenizer;

/// Which tokens of a row the loss is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossOn {
    /// A conversation's assistant tokens, a prompt/completion row's completion, a plain
    /// text's every token (as LLaMA-Factory, axolotl and TRL default).
    #[default]
    Default,
    /// The assistant's tokens (the template's `{% generation %}` spans).
    Assistant,
    /// The completion of a prompt/completion row.
    Completion,
    /// Every token.
    All,
}

impl std::str::FromStr for LossOn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "default" => Ok(Self::Default),
            "assistant" => Ok(Self::Assistant),
            "completion" => Ok(Self::Completion),
            "all" => Ok(Self::All),
            _ => Err(format!("{s:?} is not one of default, assistant, completion, all")),
        }
    }
}

/// A row's tokens, whether the loss is on each, and whether the row is a plain document
/// (the token file closes it with the end token, counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// Its token ids.
    pub ids: Vec<u32>,
    /// For each, whether the loss is on it.
    pub mask: Vec<bool>,
    /// A plain document, which the token file closes with the end token.
    pub document: bool,
}

impl Sample {
    /// Tokens the loss is on.
    pub fn counted(&self) -> usize {
        self.mask.iter().filter(|m| **m).count()
    }
}

/// `row` tokenized by `tokenizer`, through `template` where it holds messages (or why
/// there is none), its mask as `loss_on` says. An error in words where the row needs a
/// template there is none of (with the reason), a mask the template cannot give (assistant
/// tokens without `{% generation %}`), or a `loss_on` that does not apply to the row.
pub fn encode_row(
    row: &Row,
    tokenizer: &Tokenizer,
    template: Result<&ChatTemplate, &str>,
    loss_on: LossOn,
) -> Result<Sample, String> {
    let needs_template = || template.map_err(|why| format!("this row holds messages: {why}"));
    let no_extra = serde_json::Map::new();
    match row {
        Row::Text(text) => {
            if matches!(loss_on, LossOn::Assistant | LossOn::Completion) {
                return Err(format!("--loss-on {}: a plain `text` row has no such tokens", name(loss_on)));
            }
            let ids = tokenizer.encode_document(text).map_err(|e| e.to_string())?;
            Ok(Sample { mask: vec![true; ids.len()], ids, document: true })
        }
        Row::Conversation { messages, tools } => {
            if loss_on == LossOn::Completion {
                return Err("--loss-on completion: a conversation has no completion; the assistant's tokens are \
                            --loss-on assistant"
                    .into());
            }
            let template = needs_template()?;
            let rendered = template.render(messages, tools.as_ref(), false, &no_extra)?;
            let (ids, offsets) = tokenizer.encode_with_char_offsets(&rendered.text).map_err(|e| e.to_string())?;
            let mask = match loss_on {
                LossOn::All => vec![true; ids.len()],
                _ => assistant_mask(template, &rendered, &offsets)?,
            };
            Ok(Sample { ids, mask, document: false })
        }
        Row::PromptCompletion { prompt: Part::Text(p), completion: Part::Text(c), .. } => {
            if loss_on == LossOn::Assistant {
                return Err(
                    "--loss-on assistant: a prompt/completion of strings has no assistant turn; its completion \
                            is --loss-on completion"
                        .into(),
                );
            }
            let (_, eos) = tokenizer.end_of_text().map_err(|e| e.to_string())?;
            let whole = if c.ends_with(&eos) { format!("{p}{c}") } else { format!("{p}{c}{eos}") };
            let prompt = tokenizer.encode_document(p).map_err(|e| e.to_string())?;
            let ids = tokenizer.encode_document(&whole).map_err(|e| e.to_string())?;
            let mask = completion_mask(&prompt, &ids, loss_on);
            Ok(Sample { ids, mask, document: false })
        }
        Row::PromptCompletion { prompt: Part::Messages(p), completion: Part::Messages(c), tools } => {
            let template = needs_template()?;
            let alone = template.render(p, tools.as_ref(), true, &no_extra)?;
            let (prompt, _) = tokenizer.encode_with_char_offsets(&alone.text).map_err(|e| e.to_string())?;
            let both: Vec<serde_json::Value> =
                [p, c].iter().flat_map(|m| m.as_array().cloned().unwrap_or_default()).collect();
            let rendered = template.render(&serde_json::Value::Array(both), tools.as_ref(), false, &no_extra)?;
            let (ids, offsets) = tokenizer.encode_with_char_offsets(&rendered.text).map_err(|e| e.to_string())?;
            let mask = match loss_on {
                LossOn::Assistant => assistant_mask(template, &rendered, &offsets)?,
                _ => completion_mask(&prompt, &ids, loss_on),
            };
            Ok(Sample { ids, mask, document: false })
        }
        Row::PromptCompletion { .. } => Err("a prompt and a completion of different kinds".into()),
    }
}

fn name(loss_on: LossOn) -> &'static str {
    match loss_on {
        LossOn::Default => "default",
        LossOn::Assistant => "assistant",
        LossOn::Completion => "completion",
        LossOn::All => "all",
    }
}

/// Every token after the common prefix of `prompt` and `ids` (all with `LossOn::All`).
fn completion_mask(prompt: &[u32], ids: &[u32], loss_on: LossOn) -> Vec<bool> {
    if loss_on == LossOn::All {
        return vec![true; ids.len()];
    }
    let common = prompt.iter().zip(ids).take_while(|(a, b)| a == b).count();
    (0..ids.len()).map(|i| i >= common).collect()
}

/// transformers' assistant mask of `rendered` over tokens with char `offsets` (module
/// note); an error where the template marks no spans.
fn assistant_mask(
    template: &ChatTemplate,
    rendered: &Rendered,
    offsets: &[(usize, usize)],
) -> Result<Vec<bool>, String> {
    if !template.marks_assistant() {
        return Err(format!(
            "{}: the chat template marks no assistant turns, so the loss cannot be put on the assistant's tokens: give \
             a template whose assistant turns are inside {{% generation %}} ... {{% endgeneration %}} (as TRL's \
             training templates are) with --chat-template FILE, or train on every token with --loss-on all",
            template.origin()
        ));
    }
    let token_of = |char: usize| offsets.iter().position(|&(s, e)| s <= char && char < e);
    let mut mask = vec![false; offsets.len()];
    for span in &rendered.generation {
        let Some(first) = token_of(span.start) else { break };
        let last = span.end.checked_sub(1).and_then(token_of).map_or(offsets.len(), |t| t + 1);
        for m in mask.iter_mut().take(last).skip(first) {
            *m = true;
        }
    }
    Ok(mask)
}

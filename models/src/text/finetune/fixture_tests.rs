//! Rendering against transformers' own (`bench/reference/chat_templates.py`, its output
//! committed as `chat_templates.json` with the tokenizer it used): for templates written in
//! the style of LLaMA 3, Qwen2.5 (tools, `tojson`, loop controls), Qwen3 (thinking,
//! Python string methods), Mistral and Gemma (`raise_exception`, whitespace control around
//! `{% generation %}`), the text, the ids and the assistant mask
//! `apply_chat_template(..., return_assistant_tokens_mask=True)` gives, the generation
//! prompt, and the templates' refusals in their own words.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::{ChatTemplate, LossOn, Row, encode_row};
use crate::text::Tokenizer;

fn reference() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/reference"))
}

#[test]
fn rendering_matches_transformers_apply_chat_template() {
    let dir = reference();
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("chat_templates.json")).unwrap()).unwrap();
    let tokenizer = Tokenizer::from_file(&dir.join("chat_tokenizer/tokenizer.json")).unwrap();
    let special: BTreeMap<String, String> = serde_json::from_value(fixture["special_tokens"].clone()).unwrap();
    let conversations = fixture["conversations"].as_array().unwrap();
    let templates = fixture["templates"].as_array().unwrap();
    assert_eq!(templates.len(), 5);
    let mut checked = 0;
    for entry in templates {
        let file = entry["file"].as_str().unwrap();
        let source = std::fs::read_to_string(dir.join("chat_templates").join(file)).unwrap();
        let template = ChatTemplate::new(&source, file, special.clone()).unwrap();
        for case in entry["cases"].as_array().unwrap() {
            let name = case["conversation"].as_str().unwrap();
            let conversation = conversations.iter().find(|c| c["name"] == name).unwrap();
            let (messages, tools) = (&conversation["messages"], conversation.get("tools"));
            let what = format!("{file}, {name}");
            let rendered = template.render(messages, tools, false, &Default::default());
            if let Some(error) = case.get("error") {
                assert_eq!(rendered.unwrap_err(), error.as_str().unwrap(), "{what}");
                continue;
            }
            let rendered = rendered.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(rendered.text, case["text"].as_str().unwrap(), "{what}");
            let row = Row::Conversation { messages: messages.clone(), tools: tools.cloned() };
            let sample = encode_row(&row, &tokenizer, Ok(&template), LossOn::Assistant).unwrap();
            let ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
            let mask: Vec<bool> =
                (case["assistant_masks"].as_array().unwrap().iter()).map(|m| m.as_u64() == Some(1)).collect();
            assert_eq!(sample.ids, ids, "{what}");
            assert_eq!(sample.mask, mask, "{what}");
            checked += 1;
        }
        let prompt = template.render(&fixture["prompt"], None, true, &Default::default()).unwrap();
        let want = &entry["generation_prompt"];
        assert_eq!(prompt.text, want["text"].as_str().unwrap(), "{file}: the generation prompt");
        let (ids, _) = tokenizer.encode_with_char_offsets(&prompt.text).unwrap();
        assert_eq!(ids, serde_json::from_value::<Vec<u32>>(want["input_ids"].clone()).unwrap(), "{file}");
    }
    assert_eq!(checked, 21, "cases rendered (the rest are the templates' refusals)");
}

/// Prompt/completion rows as TRL's `SFTTrainer` prepares them (`completion_only_loss`): the
/// ids, and the tokens its labels keep, for strings (the completion closed by the end token
/// where it is not already) and for messages rendered by the template.
#[test]
fn prompt_completion_rows_match_trls_preprocessing() {
    use super::Part;
    let dir = reference();
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("chat_templates.json")).unwrap()).unwrap();
    let tokenizer = Tokenizer::from_file(&dir.join("chat_tokenizer/tokenizer.json")).unwrap();
    let special: BTreeMap<String, String> = serde_json::from_value(fixture["special_tokens"].clone()).unwrap();
    let trl = &fixture["prompt_completion"];
    let file = trl["template"].as_str().unwrap();
    let source = std::fs::read_to_string(dir.join("chat_templates").join(file)).unwrap();
    let template = ChatTemplate::new(&source, file, special).unwrap();
    let rows = trl["rows"].as_array().unwrap();
    let expected = trl["expected"].as_array().unwrap();
    assert_eq!(rows.len(), expected.len());
    for (i, (row, want)) in rows.iter().zip(expected).enumerate() {
        let part = |v: &serde_json::Value| match v.as_str() {
            Some(s) => Part::Text(s.to_string()),
            None => Part::Messages(v.clone()),
        };
        let row =
            Row::PromptCompletion { prompt: part(&row["prompt"]), completion: part(&row["completion"]), tools: None };
        let sample = encode_row(&row, &tokenizer, Ok(&template), LossOn::Default).unwrap();
        let ids: Vec<u32> = serde_json::from_value(want["input_ids"].clone()).unwrap();
        let mask: Vec<bool> = want["mask"].as_array().unwrap().iter().map(|m| m.as_u64() == Some(1)).collect();
        assert_eq!((sample.ids, sample.mask), (ids, mask), "row {i}");
    }
}

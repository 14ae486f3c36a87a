//! Fine-tuning rows through `zerotrain tokenize`: conversations rendered by the tokenizer's
//! chat template (or `--chat-template`), prompts and completions as TRL prepares them,
//! each row one sequence of the token file with its loss mask.

use std::path::Path;

use zerotrain_models::text::tokens::TokenFile;

use crate::hf::{folder, run_ok};
use crate::{text, zerotrain};

fn reference(file: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/reference").join(file)
}

/// Each sequence of `file`: its tokens and its mask.
fn sequences(file: &TokenFile) -> Vec<(Vec<u32>, Vec<bool>)> {
    let mut start = 0;
    (file.document_ends().into_iter())
        .map(|end| {
            let range = start..end as usize;
            start = end as usize;
            (range.clone().map(|i| file.token(i)).collect(), range.map(|i| file.counted(i)).collect())
        })
        .collect()
}

/// A file of the fixture's conversations (with tools in a row), its prompt/completion rows,
/// a plain text, and a conversation with no assistant turn, tokenized with the tokenizer's
/// own template (the `chat_template` of its `tokenizer_config.json`, LLaMA 3's style): each
/// conversation is the sequence transformers' `apply_chat_template` gives, its mask the
/// assistant mask; each prompt/completion row TRL's; the text a document closed by the end
/// token and counted whole; the row without an answer left out and counted in the summary.
/// Training on the file trains one sequence to a row and records the counted targets. `generate
/// --chat` renders a user's turn (or a messages file) with the generation prompt.
#[test]
fn tokenize_writes_conversations_and_completions_as_transformers_and_trl_do() {
    let dir = folder("chat-data");
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(reference("chat_templates.json")).unwrap()).unwrap();
    let template = std::fs::read_to_string(reference("chat_templates/llama3.jinja")).unwrap();
    std::fs::copy(reference("chat_tokenizer/tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(reference("chat_tokenizer/tokenizer_config.json")).unwrap())
            .unwrap();
    config["chat_template"] = template.into();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let llama3 = fixture["templates"].as_array().unwrap().iter().find(|t| t["file"] == "llama3.jinja").unwrap();
    let mut rows: Vec<serde_json::Value> = Vec::new();
    let mut expected: Vec<(Vec<u32>, Vec<bool>)> = Vec::new();
    let ids = |v: &serde_json::Value| serde_json::from_value::<Vec<u32>>(v.clone()).unwrap();
    let mask = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|m| m.as_u64() == Some(1)).collect::<Vec<_>>();
    for (conversation, case) in
        fixture["conversations"].as_array().unwrap().iter().zip(llama3["cases"].as_array().unwrap())
    {
        let mut row = serde_json::json!({"messages": conversation["messages"]});
        if let Some(tools) = conversation.get("tools") {
            row["tools"] = tools.clone();
        }
        rows.push(row);
        expected.push((ids(&case["input_ids"]), mask(&case["assistant_masks"])));
    }
    let trl = &fixture["prompt_completion"];
    assert_eq!(trl["template"], "llama3.jinja");
    for (row, want) in trl["rows"].as_array().unwrap().iter().zip(trl["expected"].as_array().unwrap()) {
        rows.push(row.clone());
        expected.push((ids(&want["input_ids"]), mask(&want["mask"])));
    }
    rows.push(serde_json::json!({"messages": [{"role": "user", "content": "no answer here"}]}));
    rows.push(serde_json::json!({"text": "plain words"}));
    let jsonl: String = rows.iter().map(|r| format!("{r}\n")).collect();
    let data = dir.join("chat.jsonl");
    std::fs::write(&data, jsonl).unwrap();
    let (tokenizer, out) = (dir.join("tokenizer.json"), dir.join("chat.tokens"));
    let args = ["tokenize", data.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()];
    let said = run_ok(&[&args[..], &["--out", out.to_str().unwrap(), "--valid-fraction", "0"]].concat());
    assert!(
        said.contains("in 9 sequences (5 conversations, 3 prompt/completion rows, 1 text)")
            && said.contains("; 1 row without a token to train on left out")
            && said.contains("chat template"),
        "{said}"
    );
    let file = TokenFile::open(&out).unwrap();
    file.verify().unwrap();
    assert!(file.sequences());
    let got = sequences(&file);
    assert_eq!(got.len(), expected.len() + 1, "the conversation without an answer is left out");
    for (i, (got, want)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(got, want, "sequence {i}");
    }
    let tok = zerotrain_models::text::Tokenizer::from_file(&tokenizer).unwrap();
    let mut plain = tok.encode_document("plain words").unwrap();
    plain.push(tok.end_of_text().unwrap().0);
    let n = plain.len();
    assert_eq!(got.last().unwrap(), &(plain, vec![true; n]));
    // --max-length 200: longer rows cut to their first 200 tokens (a row whose answer the
    // cut leaves out is left out), or with --drop-long left out; each counted.
    let (cut, dropped) = (dir.join("cut.tokens"), dir.join("dropped.tokens"));
    let said = run_ok(
        &[&args[..], &["--out", cut.to_str().unwrap(), "--valid-fraction", "0", "--max-length", "200"]].concat(),
    );
    let mut want: Vec<(Vec<u32>, Vec<bool>)> = Vec::new();
    let (mut truncated, mut empty) = (0, 0);
    for (ids, mask) in &expected {
        let n = ids.len().min(200);
        truncated += usize::from(ids.len() > 200);
        match mask[..n].iter().any(|m| *m) {
            true => want.push((ids[..n].to_vec(), mask[..n].to_vec())),
            false => empty += 1,
        }
    }
    assert!(truncated >= 3 && empty >= 1, "the fixture's rows exercise the cut: {truncated} cut, {empty} emptied");
    let got = sequences(&TokenFile::open(&cut).unwrap());
    assert_eq!(&got[..got.len() - 1], &want[..]);
    assert!(
        said.contains(&format!("; {truncated} rows longer than --max-length cut to their start"))
            && said.contains(&format!("; {} rows without a token to train on left out", empty + 1)),
        "{said}"
    );
    let said =
        run_ok(&[&args[..], &["--out", dropped.to_str().unwrap(), "--max-length", "200", "--drop-long"]].concat());
    let short = expected.iter().filter(|(ids, _)| ids.len() <= 200).count();
    assert_eq!(TokenFile::open(&dropped).unwrap().documents(), short + 1, "{said}");
    assert!(said.contains(&format!("; {truncated} rows longer than --max-length left out")), "{said}");
    // A Parquet file of conversations (as Hugging Face datasets ship them) tokenizes too.
    let parquet = reference("chat_rows/conversations.parquet");
    let from_parquet = dir.join("parquet.tokens");
    let said = run_ok(&[
        "tokenize",
        parquet.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--out",
        from_parquet.to_str().unwrap(),
    ]);
    assert!(said.contains("(3 conversations, 0 prompt/completion rows, 0 texts)"), "{said}");
    assert_eq!(TokenFile::open(&from_parquet).unwrap().documents(), 3);
    // --loss-on all counts every token; --loss-on completion does not apply to conversations.
    let all = dir.join("all.tokens");
    run_ok(&[&args[..], &["--out", all.to_str().unwrap(), "--loss-on", "all"]].concat());
    let all = TokenFile::open(&all).unwrap();
    assert_eq!(all.counted_in(0..all.len()), all.len());
    let refused = |extra: &[&str], needles: &[&str]| crate::hf::refused(&[&args[..], extra].concat(), needles);
    let bad = dir.join("bad.tokens");
    let bad_out = ["--out", bad.to_str().unwrap()];
    refused(&[&bad_out[..], &["--loss-on", "completion"]].concat(), &["chat.jsonl", "line 1", "no completion"]);
    // A template that refuses the roles' order (Mistral's style), in its own words.
    let mistral = reference("chat_templates/mistral.jinja");
    refused(
        &[&bad_out[..], &["--chat-template", mistral.to_str().unwrap()]].concat(),
        &["chat.jsonl", "line 4", "conversation roles must alternate"],
    );
    // A tokenizer with no template of its own: a conversation says so, and how to give one.
    let bare = dir.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(reference("chat_tokenizer/tokenizer.json"), bare.join("tokenizer.json")).unwrap();
    std::fs::copy(reference("chat_tokenizer/tokenizer_config.json"), bare.join("tokenizer_config.json")).unwrap();
    let bare_tokenizer = bare.join("tokenizer.json");
    let out_bare = zerotrain(&[
        "tokenize",
        data.to_str().unwrap(),
        "--tokenizer",
        bare_tokenizer.to_str().unwrap(),
        "--out",
        bad.to_str().unwrap(),
    ]);
    let stderr = text(&out_bare.stderr);
    assert_eq!(out_bare.status.code(), Some(1), "{stderr}");
    assert!(
        ["line 1: this row holds messages", "no chat_template", "--chat-template FILE"]
            .iter()
            .all(|n| stderr.contains(n)),
        "{stderr}"
    );
    // A template without generation blocks cannot mask the assistant's tokens.
    let unmarked = dir.join("unmarked.jinja");
    std::fs::write(&unmarked, "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    refused(
        &[&bad_out[..], &["--chat-template", unmarked.to_str().unwrap()]].concat(),
        &["{% generation %}", "--loss-on all"],
    );
    refused(&[&bad_out[..], &["--drop-long"]].concat(), &["--drop-long", "--max-length N"]);
    refused(&[&bad_out[..], &["--max-length", "1"]].concat(), &["--max-length 1"]);
    // --train-vocab trains on plain text: refused before it would replace the tokenizer.
    let before = std::fs::read(&tokenizer).unwrap();
    refused(&[&bad_out[..], &["--train-vocab", "300"]].concat(), &["--train-vocab", "fine-tuning rows"]);
    assert_eq!(std::fs::read(&tokenizer).unwrap(), before);
    let broken = dir.join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}").unwrap();
    refused(
        &[&bad_out[..], &["--chat-template", broken.to_str().unwrap()]].concat(),
        &["broken.jinja", "not a valid chat template"],
    );
    assert!(!bad.exists());
    // Trained on one sequence to a row, the loss on the counted targets alone.
    let config = dir.join("train.json");
    std::fs::write(
        &config,
        r#"{"train_micro_batch_size_per_gpu": 1, "zerotrain": {"world_size": 1},
            "model": {"hf_config": "model.json", "tokenizer": "tokenizer.json", "block_size": 8}}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("model.json"),
        r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 300}"#,
    )
    .unwrap();
    let run = dir.join("run");
    let train = |data: &'_ std::path::Path| -> Vec<String> {
        let (c, d, r) = (config.to_str().unwrap(), data.to_str().unwrap(), run.to_str().unwrap());
        ["train", "--config", c, "--data", d, "--steps", "1", "--out", r].map(String::from).to_vec()
    };
    // Without a held-out sequence there is nothing to validate on: refused naming the file.
    crate::hf::refused(
        &train(&out).iter().map(String::as_str).collect::<Vec<_>>(),
        &["chat.tokens", "held-out split holds no sequence", "--valid-fraction"],
    );
    let held = dir.join("held.tokens");
    run_ok(&[&args[..], &["--out", held.to_str().unwrap(), "--valid-fraction", "0.2"]].concat());
    // --packing is for sequences: a corpus (a plain text's token file), or the built-in
    // GPT's characters, are refused by name rather than trained as if it meant nothing.
    let (plain, corpus) = (dir.join("plain.txt"), dir.join("plain.tokens"));
    std::fs::write(&plain, "plain words and more plain words\n\n".repeat(40)).unwrap();
    let tokenize = ["tokenize", plain.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()];
    run_ok(&[&tokenize[..], &["--out", corpus.to_str().unwrap(), "--valid-fraction", "0.2"]].concat());
    let packed = |data: &Path| [train(data), vec!["--packing".into(), "none".into()]].concat();
    let refuse = |args: Vec<String>, needles: &[&str]| {
        crate::hf::refused(&args.iter().map(String::as_str).collect::<Vec<_>>(), needles);
    };
    refuse(packed(&corpus), &["--packing", "plain.tokens", "holds documents"]);
    let builtin = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/default.json");
    let gpt = ["train", "--config", builtin, "--steps", "1", "--packing", "bfd", "--out", run.to_str().unwrap()];
    refuse(gpt.map(String::from).to_vec(), &["--packing", "built-in GPT"]);
    let out_train = zerotrain(&train(&held).iter().map(String::as_str).collect::<Vec<_>>());
    let said = text(&out_train.stdout);
    assert!(out_train.status.success(), "{said}{}", text(&out_train.stderr));
    assert!(said.contains("packed into") && said.contains("of 9 tokens, the loss on their counted tokens"), "{said}");
    let line: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().next().unwrap())
            .unwrap();
    // The row drawn packs sequences cut to 9 tokens (their headers: often none counted).
    let all: usize = sequences(&TokenFile::open(&held).unwrap())
        .iter()
        .map(|(_, m)| m[1..m.len().min(9)].iter().filter(|&&c| c).count())
        .sum();
    let counted = line["counted_tokens"].as_u64().unwrap() as usize;
    assert!(counted <= all, "{line}");
    // `generate --chat`: the user's turn rendered with the generation prompt, as
    // transformers renders it (the fixture's ids), and the answer alone printed.
    let said = run_ok(&[
        "generate",
        "--config",
        config.to_str().unwrap(),
        "--chat",
        "--prompt",
        fixture["prompt"][0]["content"].as_str().unwrap(),
        "--tokens",
        "4",
        "--temperature",
        "0",
        "--json",
    ]);
    let said: serde_json::Value = serde_json::from_str(said.trim()).unwrap();
    assert_eq!(said["prompt"], llama3["generation_prompt"]["text"]);
    assert_eq!(said["prompt_ids"], llama3["generation_prompt"]["input_ids"]);
    let new: Vec<u32> = serde_json::from_value(said["ids"].clone()).unwrap();
    let eos = tok.end_of_text().unwrap().0;
    let answer = if new.last() == Some(&eos) { &new[..new.len() - 1] } else { &new[..] };
    assert_eq!(said["text"], tok.decode(answer).unwrap());
    let messages = dir.join("messages.json");
    std::fs::write(&messages, fixture["prompt"].to_string()).unwrap();
    let from_file = run_ok(&[
        "generate",
        "--config",
        config.to_str().unwrap(),
        "--chat",
        "--messages",
        messages.to_str().unwrap(),
        "--tokens",
        "4",
        "--temperature",
        "0",
        "--json",
    ]);
    let from_file: serde_json::Value = serde_json::from_str(from_file.trim()).unwrap();
    assert_eq!(from_file["prompt_ids"], said["prompt_ids"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

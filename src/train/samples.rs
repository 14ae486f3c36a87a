//! What `zerotrain train` prints of the trained model.

use zerotrain_models::data::Corpus;
use zerotrain_models::{CausalLm, Gpt, GptConfig, Sampling};

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

//! QLoRA through the command line: `zerotrain.lora.quantize: "nf4"`.

use super::lora::{lora_config, write_kv1_llama};
use super::{folder, fresh_llama, run_ok, train_args};

/// QLoRA from the command line on two ranks at stage 3: `config check` gives each rank's
/// bytes of the NF4 base (computed here from the shapes: half a byte a value of the layers'
/// matrices in words of eight and four bytes a block of 64; the embedding and norms in
/// f32), and `train`'s summary measures each rank holding that share to within the units'
/// padding.
#[test]
fn qlora_ranks_hold_their_share_of_the_nf4_base_as_config_check_counts() {
    let dir = folder("qlora");
    let (_, tokens) = fresh_llama(&dir, 1, "");
    write_kv1_llama(&dir);
    let lora = r#"{"r": 2, "target_modules": "all-linear", "quantize": "nf4"}"#;
    let config = lora_config(&dir, "nf4", (2, 3, 3, 1), lora);
    // q, k, v, o, gate, up, down of each of the 2 layers (kv heads 1 of width 8).
    let matrices = [16 * 16, 16 * 8, 16 * 8, 16 * 16, 16 * 24, 16 * 24, 24 * 16u64];
    let nf4: u64 = 2 * matrices.iter().map(|n| 4 * (n.div_ceil(8) + n.div_ceil(64))).sum::<u64>();
    let rest = 4 * (280 * 16 + 2 * 2 * 16 + 16);
    let share = (nf4 + rest).div_ceil(2);
    let printed = run_ok(&["config", "check", config.to_str().unwrap()]);
    assert!(printed.contains("its shard, the layers' matrices in NF4"), "{printed}");
    assert!(printed.contains(&format!("({share} bytes a rank)")), "{printed}");
    // `estimate` by stage: fp32 AdamW's 16 bytes a trained parameter (its shard's from stage
    // 1 on, as the ZeRO paper counts), the base whole in f32 below stage 3, NF4's share at 3.
    let trained: u64 = 2 * [(16, 16), (16, 8), (16, 8), (16, 16), (16, 24), (16, 24), (24, 16)]
        .iter()
        .map(|(i, o)| 2 * (i + o))
        .sum::<u64>();
    let json = run_ok(&["estimate", "--model-config", config.to_str().unwrap(), "--world-size", "2", "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&json).unwrap();
    let rows = rows["lora"].as_array().expect("LoRA rows");
    let whole = 4 * (matrices.iter().sum::<u64>() * 2 + (280 * 16 + 2 * 2 * 16 + 16));
    let expected = [
        (16 * trained, whole),
        (8 * trained + 8 * trained / 2, whole),
        (4 * trained + 12 * trained / 2, whole),
        (16 * trained / 2, share),
    ];
    for (row, (trained_bytes, frozen_bytes)) in rows.iter().zip(expected) {
        assert_eq!(
            (row["trained_bytes"].as_u64().unwrap(), row["frozen_bytes"].as_u64().unwrap()),
            (trained_bytes, frozen_bytes),
            "{row}"
        );
    }
    assert_eq!(rows[3]["nf4"], true);
    let summary = run_ok(&train_args(&config, &tokens, "2", &dir.join("run"), &[]));
    let table: Vec<&str> = summary.lines().skip_while(|l| !l.starts_with("model states per rank")).skip(1).collect();
    assert!(table[0].trim_end().ends_with("frozen"), "{summary}");
    for row in &table[1..3] {
        let frozen: u64 = row.split_whitespace().last().unwrap().parse().unwrap();
        // Each layer's words padded to the ranks, the root's elements to 16 a rank.
        assert!(frozen >= share && frozen <= share + 4 * 2 + 4 * 16, "{frozen} bytes, the share {share}: {summary}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

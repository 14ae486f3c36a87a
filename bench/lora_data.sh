# Sourced by bench/lora_memory.sh and bench/lora_speed.sh: `lora_data BIN WORK` writes,
# once, the token data both benchmark (WORK/data.tokens, 104001 tokens of random words,
# 0.6% held out) with its tokenizer (WORK/tokenizer.json, a vocabulary of 400 trained on it).
lora_data() {
  local bin="$1" work="$2"
  if [ -f "$work/data.tokens" ]; then return; fi
  python3 - "$work/text.txt" <<'PY'
import random, sys
random.seed(7)
words = ["the", "model", "trains", "adapters", "on", "a", "frozen", "base", "of", "shards", "each", "rank", "holds"]
with open(sys.argv[1], "w") as f:
    for _ in range(4000):
        f.write(" ".join(random.choice(words) for _ in range(24)) + ".\n")
PY
  "$bin" tokenize "$work/text.txt" --tokenizer "$work/tokenizer.json" --train-vocab 400 \
    --out "$work/data.tokens" --valid-fraction 0.006 > /dev/null
}

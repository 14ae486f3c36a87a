#!/usr/bin/env bash
# Speed of `zerotrain tokenize` on a chat file (issue target: >= 20 MB/s per core), with the
# plain-text path on the same words beside it.
#   [BIN=path/to/zerotrain] bench/chat_tokenize.sh [MB]   (default 20)
# Writes, under $WORK (default /tmp/zerotrain-bench-chat): a byte-level BPE of 8,000 tokens
# trained on 2 MB of the text, a .jsonl of conversations (a system turn, then two to six
# user/assistant turns of 10-120 words each, ASCII with some accented words) totalling MB
# megabytes, and the same turns as a plain text file; then tokenizes each three times
# through the release binary, rendering the conversations with the Qwen2.5-style template
# of bench/reference/chat_templates, and prints what `tokenize` says of its speed. The
# machine's cores: `nproc`; MB/s per core is the figure over that.
set -euo pipefail
cd "$(dirname "$0")/.."
MB="${1:-20}"
WORK="${WORK:-/tmp/zerotrain-bench-chat}"
mkdir -p "$WORK"
# BIN: a zerotrain binary already built (the dev profile is optimised too); else the
# release one is built.
if [ -z "${BIN:-}" ]; then
  cargo build --release --locked -q
  BIN=target/release/zerotrain
fi
python3 - "$WORK" "$MB" <<'PY'
import json, os, random, sys
work, mb = sys.argv[1], float(sys.argv[2])
random.seed(11)
words = ("the a model trains on each rank holds shards of weights answer question why how "
         "because gradient optimizer state café naïve über résumé token window sequence mask loss").split()
def sentence(n):
    return " ".join(random.choice(words) for _ in range(n)).capitalize() + "."
with open(os.path.join(work, "sample.txt"), "w") as f:
    while f.tell() < 2e6:
        f.write(sentence(random.randint(10, 120)) + "\n\n")
with open(os.path.join(work, "chat.jsonl"), "w") as chat, open(os.path.join(work, "plain.txt"), "w") as plain:
    while chat.tell() < mb * 1e6:
        messages = [{"role": "system", "content": "You answer briefly."}]
        for _ in range(random.randint(1, 3)):
            messages.append({"role": "user", "content": sentence(random.randint(10, 60))})
            messages.append({"role": "assistant", "content": sentence(random.randint(20, 120))})
        chat.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
        plain.write("\n".join(m["content"] for m in messages) + "\n\n")
PY
"$BIN" tokenize "$WORK/sample.txt" --tokenizer "$WORK/tokenizer.json" --train-vocab 8000 --out "$WORK/sample.tokens" > /dev/null
echo "cores: $(nproc); chat file $(du -m "$WORK/chat.jsonl" | cut -f1) MB"
for i in 1 2 3; do
  "$BIN" tokenize "$WORK/chat.jsonl" --tokenizer "$WORK/tokenizer.json" --out "$WORK/chat.tokens" \
    --chat-template bench/reference/chat_templates/qwen2_5.jinja | sed 's/^/chat:  /'
  "$BIN" tokenize "$WORK/plain.txt" --tokenizer "$WORK/tokenizer.json" --out "$WORK/plain.tokens" | sed 's/^/plain: /'
done

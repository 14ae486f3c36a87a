"""Parquet files of fine-tuning rows, as Hugging Face datasets ship them, beside the same
rows as JSON lines, for the test that reads both (committed in chat_rows/; run with
pyarrow to make them again).

  make
      chat_rows/rows.jsonl: conversations (a list of {role, content} structs, non-ASCII
      among them), prompt/completion strings and a text, in one file;
      chat_rows/conversations.parquet (snappy, two row groups) and
      chat_rows/completions.parquet (zstd) hold the same rows by kind;
      chat_rows/bad.parquet: `messages` as a string column (a row the reader refuses).
"""

import json
import os
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_rows")

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                  {"role": "assistant", "content": "4."}]},
    {"messages": [{"role": "user", "content": "Un café ☕"}, {"role": "assistant", "content": "Voilà."}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]},
]
COMPLETIONS = [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "Capital of France:", "completion": " Paris"}]


def make():
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(HERE, exist_ok=True)
    with open(os.path.join(HERE, "rows.jsonl"), "w", encoding="utf-8") as f:
        for row in CONVERSATIONS + COMPLETIONS:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    pq.write_table(pa.Table.from_pylist(CONVERSATIONS), os.path.join(HERE, "conversations.parquet"),
                   compression="snappy", row_group_size=2)
    pq.write_table(pa.Table.from_pylist(COMPLETIONS), os.path.join(HERE, "completions.parquet"), compression="zstd")
    bad = [{"messages": json.dumps(CONVERSATIONS[0]["messages"])}]
    pq.write_table(pa.Table.from_pylist(bad), os.path.join(HERE, "bad.parquet"))


if __name__ == "__main__":
    if sys.argv[1:] != ["make"]:
        sys.exit(__doc__)
    make()

"""transformers' own rendering of conversations through chat templates, kept as a fixture
(chat_templates.json) so that CI needs no torch or transformers.

  make [--out bench/reference/chat_templates.json]
      makes a tiny tokenizer (hf_models.py make: byte-level BPE with <|begin_of_text|> and
      <|im_end|> among its special tokens), then for each template in chat_templates/ (written
      for these tests in the style of LLaMA 3, Qwen2.5 with tools, Qwen3 with thinking,
      Mistral and Gemma, each marking the assistant's turns with {% generation %} as TRL's
      training templates do) and each conversation below that it accepts:
      tokenizer.apply_chat_template(messages, tools=..., tokenize=True, return_dict=True,
      return_assistant_tokens_mask=True) -> the rendered text, input_ids and assistant_masks;
      with add_generation_prompt=True -> the text and ids; a conversation a template refuses
      -> the message raise_exception gave; and TRL's SFTTrainer preprocessing
      (completion_only_loss) of the prompt/completion rows below, plain and conversational
      (through the LLaMA 3 style template): input_ids and which tokens its labels keep.
      Records the versions beside.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "chat_templates")
# The tokenizer the fixture's ids are of, kept beside it so that the test needs no Python.
TOKENIZER = os.path.join(HERE, "chat_tokenizer")
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Das Wetter in einer Stadt — heute",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CONVERSATIONS = [
    {"name": "system-user-assistant", "messages": [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."}]},
    {"name": "two-turns-non-ascii", "messages": [
        {"role": "user", "content": "Un café, s'il vous plaît ☕"},
        {"role": "assistant", "content": "  Voilà votre café — naïve question? \n"},
        {"role": "user", "content": "Merci!"},
        {"role": "assistant", "content": "De rien."}]},
    {"name": "thinking", "messages": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\nIt has no divisors but 1 and 7.\n</think>\n\nYes, 7 is prime."}]},
    {"name": "tool-call", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Wie ist das Wetter in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "°C"}}}]},
        {"role": "tool", "content": "{\"temperature\": 3}"},
        {"role": "assistant", "content": "3 °C in Zürich."}]},
    {"name": "out-of-order", "messages": [
        {"role": "user", "content": "Hello"},
        {"role": "user", "content": "Hello again"},
        {"role": "assistant", "content": "Hi."}]},
]
# The conversation each template is asked for with add_generation_prompt=True.
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
# Prompt/completion rows for TRL, with the template the conversational ones are rendered by.
PROMPT_COMPLETION_TEMPLATE = "llama3.jinja"
PROMPT_COMPLETION = [
    {"prompt": "2 + 2 =", "completion": " 4"},
    {"prompt": "Capital of France:", "completion": " Paris<|im_end|>"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
     "completion": [{"role": "assistant", "content": "4, naïvely."}]},
]


def trl_rows(tok, model_dir, template, root):
    """TRL's SFTTrainer preprocessing of PROMPT_COMPLETION: ids and the tokens its labels keep."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    import trl

    tok.chat_template = template
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = []
    # Plain and conversational rows apart: one dataset holds one kind.
    for kind in (PROMPT_COMPLETION[:2], PROMPT_COMPLETION[2:]):
        args = SFTConfig(output_dir=os.path.join(root, "trl"), report_to=[], max_length=None, packing=False,
                         completion_only_loss=True, use_cpu=True, bf16=False)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(kind), processing_class=tok)
        for row in trainer.train_dataset:
            out.append({"input_ids": list(row["input_ids"]), "mask": [int(l != -100) for l in row["labels"]]})
    tok.chat_template = None
    return {"trl_version": trl.__version__, "template": PROMPT_COMPLETION_TEMPLATE, "rows": PROMPT_COMPLETION,
            "expected": out}


def make(args):
    import transformers
    from transformers import AutoTokenizer

    out = {"transformers_version": transformers.__version__, "special_tokens": SPECIAL,
           "prompt": PROMPT, "conversations": CONVERSATIONS, "templates": []}
    with tempfile.TemporaryDirectory() as root:
        made = os.path.join(root, "tok")
        subprocess.run([sys.executable, os.path.join(HERE, "hf_models.py"), "make", made, "--family", "llama"],
                       check=True, stdout=subprocess.DEVNULL)
        os.makedirs(TOKENIZER, exist_ok=True)
        shutil.copy(os.path.join(made, "tokenizer.json"), os.path.join(TOKENIZER, "tokenizer.json"))
        with open(os.path.join(made, "tokenizer_config.json")) as f:
            config = json.load(f)
        config.update(SPECIAL)
        config.pop("chat_template", None)
        with open(os.path.join(TOKENIZER, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)
            f.write("\n")
        tok = AutoTokenizer.from_pretrained(TOKENIZER)
        for file in sorted(os.listdir(TEMPLATES)):
            with open(os.path.join(TEMPLATES, file), encoding="utf-8") as f:
                template = f.read()
            entry = {"file": file, "cases": []}
            for conv in CONVERSATIONS:
                case = {"conversation": conv["name"]}
                try:
                    got = tok.apply_chat_template(conv["messages"], tools=conv.get("tools"), chat_template=template,
                                                  tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                    case["text"] = tok.apply_chat_template(conv["messages"], tools=conv.get("tools"),
                                                           chat_template=template, tokenize=False)
                    case["input_ids"] = list(got["input_ids"])
                    case["assistant_masks"] = list(got["assistant_masks"])
                except Exception as e:  # noqa: BLE001  (the template's own refusal)
                    if type(e).__name__ != "TemplateError":
                        raise
                    case["error"] = str(e)
                entry["cases"].append(case)
            text = tok.apply_chat_template(PROMPT, chat_template=template, tokenize=False, add_generation_prompt=True)
            ids = tok.apply_chat_template(PROMPT, chat_template=template, tokenize=True, return_dict=True,
                                          add_generation_prompt=True)["input_ids"]
            entry["generation_prompt"] = {"text": text, "input_ids": list(ids)}
            out["templates"].append(entry)
        with open(os.path.join(TEMPLATES, PROMPT_COMPLETION_TEMPLATE), encoding="utf-8") as f:
            out["prompt_completion"] = trl_rows(tok, made, f.read(), root)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default=os.path.join(HERE, "chat_templates.json"))
    make(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())

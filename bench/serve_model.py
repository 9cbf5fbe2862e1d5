"""A model folder `vllm serve` can serve with dummy weights and no download.

`vllm serve` tokenizes text, so the model needs a tokenizer, and the GPU machine cannot fetch one.
This builds a word-level one with the `tokenizers` library: token id i is the word `w{i}`, words are
split on whitespace and joined with spaces, so a text of N such words is exactly N tokens and
decode/encode round-trips. That keeps `vllm bench serve`'s datasets (which decode random ids and
re-encode them) exact, and lets the chat client count tokens as words. The last ids are the
Llama-3 special tokens (`<|begin_of_text|>` ...), and a minimal Llama-3-style chat template joins
the messages, so /v1/chat/completions works too.

    python -m bench serve_model --config bench/e2e_models/llama3-8b/config.json --out /tmp/served
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>")
EOT = "<|eot_id|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
    "{{ m['content'] }} <|eot_id|> {% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}"
)


def word(token_id: int) -> str:
    return f"w{token_id}"


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` over `vocab_size` ids: words w0.. then the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = (*SPECIAL, EOT)
    plain = vocab_size - len(specials)
    vocab = {word(i): i for i in range(plain)}
    vocab.update({tok: plain + k for k, tok in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    return tok


def build_model_dir(config_json: Path, out: Path) -> Path:
    """`out` holds config.json (copied) plus tokenizer.json/tokenizer_config.json; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(config_json.read_text())
    vocab_size = int(config["vocab_size"])
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eot_id = tok.token_to_id(EOT)
    config = {**config, "bos_token_id": tok.token_to_id(SPECIAL[0]), "eos_token_id": eot_id}
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL[0],
                "eos_token": EOT,
                "pad_token": SPECIAL[1],
                "model_max_length": int(config.get("max_position_embeddings", 131072)),
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eot_id}))
    for extra in ("special_tokens_map.json",):
        (out / extra).unlink(missing_ok=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="a model's config.json")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.out.exists() and not a.out.is_dir():
        ap.error(f"--out {a.out} exists and is not a folder")
    shutil.rmtree(a.out, ignore_errors=True)
    print(build_model_dir(a.config, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The recipes' tiny local models load back through transformers' Auto classes as they were saved.

Recipes read their models with ``AutoTokenizer.from_pretrained(folder)``; transformers rebuilds the
tokenizer of some model types (Qwen2) from vocabulary and merges with its own rules instead of the
saved ``tokenizer.json``. A tiny model whose tokenizer comes back different trains on other
sequences than the data says (a Qwen2 run once saw 670 tokens of a 1,904-word row).
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.recipes.nb import RECIPES

pytest.importorskip("transformers")
sys.path.insert(0, str(RECIPES))

from _smoke import ARCH_OVERRIDES, make_chat_jsonl, make_tiny_causal_lm  # noqa: E402


@pytest.mark.parametrize("arch", sorted(ARCH_OVERRIDES))
def test_auto_tokenizer_tokenizes_as_saved(arch: str, tmp_path) -> None:
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    folder = make_tiny_causal_lm(arch, tmp_path / "model")
    rows = make_chat_jsonl(tmp_path / "chat.jsonl", num_rows=2, words_per_message=50)
    messages = json.loads(open(rows).readline())["messages"]

    loaded = AutoTokenizer.from_pretrained(folder)
    saved = PreTrainedTokenizerFast(tokenizer_file=f"{folder}/tokenizer.json")
    text = loaded.apply_chat_template(messages, tokenize=False)
    ids = loaded(text)["input_ids"]
    assert ids == saved(text)["input_ids"]
    assert loaded.unk_token_id not in ids
    # one token per word plus the chat template's markers
    assert 100 <= len(ids) <= 110
    assert loaded.decode(ids, skip_special_tokens=True).split() == " ".join(m["content"] for m in messages).split()
    assert AutoConfig.from_pretrained(folder).vocab_size >= len(loaded)

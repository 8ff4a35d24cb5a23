"""Tiny causal language models of real architectures, plus a locally trained tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .words import DIGITS, WORDS

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Small dimensions that keep each architecture's structure (attention layout, MoE routing).
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "olmo": {},
    "olmo2": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
    "gpt_oss": {
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,  # YaRN expects 32 x the original 4096 context
    },
}


# Split rule of GPT-2-style byte-level BPE tokenizers (Qwen2's): letters keep their leading space.
_BYTE_LEVEL_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Model types whose tokenizer transformers rebuilds from vocab + merges with its own rules instead of
# loading tokenizer.json as saved (transformers 5's MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): they
# get a byte-level BPE tokenizer built with those same rules, so the rebuilt one tokenizes alike.
BYTE_LEVEL_ARCHS = {"qwen2"}


def make_tokenizer(out_dir: str | Path | None = None, byte_level: bool = False) -> Any:
    """Train a tokenizer over the shared vocabulary and wrap it for transformers.

    Args:
        out_dir: when given, the tokenizer is also saved there (``save_pretrained``).
        byte_level: a byte-level BPE (GPT-2 / Qwen2 style; every word and " word" of the shared
            vocabulary is one token) instead of a word-level tokenizer.

    Returns:
        A ``PreTrainedTokenizerFast`` with pad/eos/bos tokens and a chat template.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [" ".join(WORDS), " ".join(DIGITS), "{ } : , \" [ ] . -"]
    if byte_level:
        tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_BYTE_LEVEL_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=100_000, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        corpus += [" ".join(WORDS[::-1]), "\n".join(WORDS)]  # each word both after a space and alone
    else:
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|end|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_causal_lm(
    arch: str, out_dir: str | Path, seed: int = 0, dtype: str = "float32", device: str = "cpu", **config_overrides: Any
) -> str:
    """Build a tiny randomly initialised causal LM of architecture ``arch`` and save it.

    The folder holds ``config.json``, safetensors weights and a tokenizer, so
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` and ``AutoTokenizer.from_pretrained(out_dir)``
    load it exactly as they would load a hub checkpoint.

    Args:
        arch: a transformers ``model_type`` listed in :data:`ARCH_OVERRIDES` (e.g. ``"llama"``).
        out_dir: folder to write.
        seed: seed for the random weights.
        dtype: the weights' dtype as saved (``"bfloat16"`` halves the files of a full-size model).
        device: where the weights are initialised (``"cuda"`` builds a full-size model in seconds).
        **config_overrides: extra config fields (e.g. ``num_hidden_layers=4``).

    Returns:
        ``out_dir`` as a string.

    Raises:
        ValueError: ``arch`` is not one of the known architectures.
    """
    if arch not in ARCH_OVERRIDES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(ARCH_OVERRIDES)}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out, byte_level=arch in BYTE_LEVEL_ARCHS)
    settings = {**_COMMON, **ARCH_OVERRIDES[arch], **config_overrides}
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **settings,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(out))
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return str(out)

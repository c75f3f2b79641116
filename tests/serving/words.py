"""The suite's word-level tokenizer for serving tests (`w1` ... `w63`, `<pad>` at 0, words
joined by spaces), with a chat template whose words are in the vocabulary."""

from __future__ import annotations

VOCAB = 64
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}w1 {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w20{% endif %}"
)


def word_tokenizer(bos: bool = False, template: str | None = CHAT_TEMPLATE):
    """With `bos`, `w3` is its BOS, which encoding puts first (and decoding leaves out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {}
    if bos:
        core.post_processor = processors.TemplateProcessing(
            single="w3 $A", special_tokens=[("w3", 3)]
        )
        extra["bos_token"] = "w3"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", **extra)
    tokenizer.chat_template = template
    return tokenizer

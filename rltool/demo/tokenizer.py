"""The demo tokenizer: byte-level BPE with single-digit tokens and a ChatML template.

Design: docs/demo.md#the-demo-tokenizer
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rltool.demo.data import GSM8K_TINY_DIR, Problem, read_jsonl

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
VOCAB_SIZE = 1024  # an upper bound: the templated corpus runs out of merges well below it

# Qwen-style ChatML without an implicit system prompt: exactly the messages given.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus(problems: Sequence[Problem]) -> Iterable[str]:
    for p in problems:  # the role names as the chat template places them, so they merge too
        yield f"user\n{p.question}"
        yield f"assistant\n{p.answer}"


def train_demo_tokenizer(problems: Sequence[Problem] | None = None) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on ``problems`` (default: the shipped train split)."""
    if problems is None:
        problems = read_jsonl(GSM8K_TINY_DIR / "train.jsonl")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(problems), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        padding_side="left",  # set in the constructor so that save_pretrained keeps it
        chat_template=CHAT_TEMPLATE,
    )

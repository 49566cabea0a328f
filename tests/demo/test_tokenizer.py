"""The demo tokenizer: single-digit tokens, ChatML template, specials, save/load round trip."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rltool.demo.data import prompt_messages
from rltool.demo.tokenizer import IM_END, IM_START, PAD, train_demo_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_demo_tokenizer()


def test_digits_are_split_one_per_token(tok):
    pieces = tok.convert_ids_to_tokens(tok("12345 + 67", add_special_tokens=False)["input_ids"])
    digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digits == ["1", "2", "3", "4", "5", "6", "7"]


def test_round_trip_text(tok):
    text = "Tom has 17 apples and buys 5 more.\n7 + 5 = 12\n#### 12 ünïcode"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens(tok):
    assert tok.eos_token == IM_END and tok.pad_token == PAD
    assert tok.padding_side == "left"
    for special in (IM_START, IM_END, PAD):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert (
        tok("7", add_special_tokens=True)["input_ids"]
        == tok("7", add_special_tokens=False)["input_ids"]
    )


def test_chat_template_renders_chatml(tok):
    text = tok.apply_chat_template(
        prompt_messages("What is 2 + 3?"), add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    with_answer = tok.apply_chat_template(
        [*prompt_messages("Q"), {"role": "assistant", "content": "A"}], tokenize=False
    )
    assert with_answer == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"


def test_save_and_load_keep_template_padding_and_vocab(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.padding_side == "left"
    assert loaded.chat_template == tok.chat_template
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)


def test_training_is_deterministic(tok):
    assert train_demo_tokenizer().get_vocab() == tok.get_vocab()

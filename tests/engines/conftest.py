"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from rltool.demo.tokenizer import train_demo_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()

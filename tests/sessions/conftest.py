"""The tokenizer fixture of the session-server tests (demo BPE + the tool chat template)."""

from __future__ import annotations

import pytest

from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.sessions import TOOL_CHAT_TEMPLATE


@pytest.fixture(scope="session")
def tokenizer():
    tok = train_demo_tokenizer()
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok

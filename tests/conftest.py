"""Fixtures shared across test folders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rltool.agent_loops.sandbox_task import temp_dir
from rltool.app.demo_model import demo_model_config
from rltool.demo.tokenizer import train_demo_tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models: a second thread only adds synchronisation, and on a loaded machine the
    oversubscribed OpenMP threads make a step many times slower. Module scope: set before
    the module-scoped model fixtures, restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A directory for a test's Unix socket: tmp_path under a long TMPDIR may leave no room
    for one (a socket's path may not pass 107 bytes)."""
    with temp_dir("rltool-test-sock-", for_socket=True) as path:
        yield path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with the demo tokenizer, saved as an ordinary HF checkpoint
    (loaded through ``model.path=DIR`` like a user's model; read-only for tests)."""
    out = tmp_path_factory.mktemp("tiny-ckpt")
    tokenizer = train_demo_tokenizer()
    torch.manual_seed(0)
    cfg = demo_model_config(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

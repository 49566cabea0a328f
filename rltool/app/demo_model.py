"""The built-in demo model ``builtin:tiny-gsm8k``: a ~3M-parameter Qwen2 warm-started by SFT.

``ensure_demo_checkpoint`` builds it once into the cache and returns the path.
Design: docs/demo.md#the-demo-model
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from rltool.app.rg_warm_start import sums_problems
from rltool.builtin import (
    DEMO_NAME,
    MOE_NAME,
    RG_SUMS_NAME,
    STUDENT_NAME,
    check_builtin_model,
    demo_cache_dir,
    is_builtin,
)
from rltool.config.schema import SamplingConfig
from rltool.demo.data import GSM8K_TINY_DIR, Problem, extract_answer, prompt_messages, read_jsonl
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.engines.hf import HFEngine
from rltool.rollout.state import IGNORE_INDEX
from rltool.training.optim import lr_multiplier

OPTIMIZER_FILE = "optimizer.pt"
BUILD_INFO_FILE = "build_info.json"


@dataclass(frozen=True)
class SFTSettings:
    """The supervised warm start.

    Greedy accuracy climbs steeply once the model has learned to copy the
    operands (from ~15% to ~60% within a few dozen steps), so a fixed step
    count would land anywhere in that range depending on the CPU's float
    rounding. Training stops instead at the first probe that reaches
    ``target_accuracy``: a deterministic rule for a given seed and machine that
    lands near the target on any machine.
    """

    max_steps: int = 300  # the cosine schedule's length; the probe stops it at step 80
    batch_size: int = 16  # small batches learn more per example here than large ones
    lr: float = 1e-3
    warmup_steps: int = 20
    target_accuracy: float | None = 0.35  # None = train all max_steps
    probe_from: int = 80  # first step with a probe (earlier ones cannot reach the target)
    probe_every: int = 20  # steps between greedy-accuracy probes
    probe_problems: int = 100  # train problems the probe answers
    eval_problems: int = 300  # held-out problems for the accuracy in build_info.json (0 = skip)


# The weak student of recipes/gsm8k_tiny_distill.yaml: the demo model, tokenizer and data,
# SFT stopped after 30 steps (before it can answer), so the demo checkpoint can teach it.
STUDENT_SFT = SFTSettings(max_steps=30, warmup_steps=10, target_accuracy=None, eval_problems=100)
# builtin name -> extra build_demo_checkpoint arguments
BUILD_ARGS: dict[str, dict] = {
    "tiny-gsm8k": {},
    # reasoning-gym sums (app/rg_warm_start.py): stopped at a quarter greedy accuracy
    "tiny-rg-sums": {
        "settings": SFTSettings(target_accuracy=0.25, probe_from=20, probe_every=10),
        "name": RG_SUMS_NAME,
        "data": "reasoning_gym_sums",
    },
    "tiny-gsm8k-student": {"settings": STUDENT_SFT, "name": STUDENT_NAME},
    "tiny-gsm8k-moe": {"name": MOE_NAME, "moe": True},
}


def demo_model_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 688,
) -> Qwen2Config:
    """A small Qwen2 config sized to ``tokenizer`` (tied embeddings, fp32, sdpa)."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        attn_implementation="sdpa",
    )


def demo_moe_config(tokenizer: PreTrainedTokenizerBase) -> Qwen3MoeConfig:
    """The MoE demo (``builtin:tiny-gsm8k-moe``): the dense demo's shape with every MLP a
    Qwen3-MoE block of 8 experts, top-2, each half the dense MLP's width (so a token's
    expert compute matches the dense model's)."""
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=688,
        moe_intermediate_size=344,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        attn_implementation="sdpa",
    )


def encode_sft_example(
    tokenizer: PreTrainedTokenizerBase, problem: Problem
) -> tuple[list[int], list[int]]:
    """(input_ids, labels): the chat prompt unsupervised, the answer and its EOS supervised."""
    prompt = tokenizer.apply_chat_template(
        prompt_messages(problem.question), add_generation_prompt=True
    )
    prompt_ids = list(prompt["input_ids"])
    answer_ids = tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    return prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids


def _right_pad(rows: Sequence[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)  # [B, L]


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    settings: SFTSettings,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> tuple[torch.optim.AdamW, int]:
    """Supervised warm start on ``problems``; returns the optimizer (its state is saved) and
    the number of steps taken."""
    examples = [encode_sft_example(tokenizer, p) for p in problems]
    probe = list(problems[: settings.probe_problems])
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(s, settings.warmup_steps, settings.max_steps, "cosine", 0.1),
    )
    task = progress.add_task("SFT warm start", total=settings.max_steps) if progress else None
    model.train()
    for step in range(1, settings.max_steps + 1):
        picks = torch.randint(len(examples), (settings.batch_size,), generator=generator).tolist()
        input_ids = _right_pad([examples[i][0] for i in picks], tokenizer.pad_token_id)  # [B, L]
        labels = _right_pad([examples[i][1] for i in picks], IGNORE_INDEX)  # [B, L]
        attention_mask = _right_pad([[1] * len(examples[i][0]) for i in picks], 0)  # [B, L]
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress.update(task, advance=1, description=f"SFT warm start (loss {loss.item():.3f})")
        if (
            settings.target_accuracy is not None
            and step >= settings.probe_from
            and (step - settings.probe_from) % settings.probe_every == 0
        ):
            accuracy = greedy_accuracy(model, tokenizer, probe)
            if progress is not None:
                progress.update(task, description=f"SFT warm start (probe accuracy {accuracy:.2f})")
            if accuracy >= settings.target_accuracy:
                break
    return optimizer, step


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    batch_size: int = 100,
) -> float:
    """Fraction of ``problems`` whose greedy answer after ``####`` equals the reference."""
    prompts = [
        list(
            tokenizer.apply_chat_template(prompt_messages(p.question), add_generation_prompt=True)[
                "input_ids"
            ]
        )
        for p in problems
    ]
    gens = HFEngine(model, tokenizer, batch_size=batch_size).generate(
        prompts, SamplingConfig(temperature=0.0, max_new_tokens=24)
    )
    correct = sum(
        extract_answer(g.text) == extract_answer(p.answer)
        for g, p in zip(gens, problems, strict=True)
    )
    return correct / len(problems)


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        transient=False,
    )


def build_demo_checkpoint(
    out_dir: str | Path,
    seed: int = 0,
    settings: SFTSettings | None = None,
    show_progress: bool = True,
    name: str = DEMO_NAME,
    moe: bool = False,
    data: str = "gsm8k_tiny",
) -> dict:
    """Train tokenizer and model, save them to ``out_dir``; returns the build info.

    ``out_dir`` gets ``config.json``, ``model.safetensors``, the tokenizer files,
    ``optimizer.pt`` (the AdamW state_dict after SFT) and ``build_info.json``.
    Deterministic in ``seed``; the caller's global RNG state is left untouched. ``moe``:
    the Qwen3-MoE shape of ``demo_moe_config`` instead of the dense Qwen2. ``data``: the
    shipped GSM8K-style split, or ``reasoning_gym_sums`` (``rg_warm_start.sums_problems``).
    """
    settings = settings or SFTSettings()
    out = Path(out_dir)
    if data == "reasoning_gym_sums":
        train, test = sums_problems()
    else:
        train = read_jsonl(GSM8K_TINY_DIR / "train.jsonl")
        test = read_jsonl(GSM8K_TINY_DIR / "test.jsonl")
    tokenizer = train_demo_tokenizer(train)
    progress = _progress() if show_progress else None
    with (
        torch.random.fork_rng(devices=[]),
        progress if progress is not None else contextlib.nullcontext(),
    ):
        torch.manual_seed(seed)
        if moe:
            model: PreTrainedModel = Qwen3MoeForCausalLM(demo_moe_config(tokenizer))
        else:
            model = Qwen2ForCausalLM(demo_model_config(tokenizer))
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        optimizer, steps = train_sft(model, tokenizer, train, settings, generator, progress)
        sft_seconds = time.perf_counter() - start
        n_eval = settings.eval_problems and min(settings.eval_problems, len(test))
        accuracy = greedy_accuracy(model, tokenizer, test[:n_eval]) if n_eval else None
    info = {
        "name": name,
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft": asdict(settings),
        "sft_steps": steps,
        "sft_seconds": round(sft_seconds, 1),
        "test_greedy_accuracy": accuracy,
        "test_problems": n_eval,
    }
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
    (out / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def ensure_demo_checkpoint(show_progress: bool = True, builtin: str = "tiny-gsm8k") -> Path:
    """The checkpoint directory of ``builtin:<builtin>``, built on first use (atomically:
    temp dir, then rename)."""
    build_args = BUILD_ARGS[builtin]
    final = demo_cache_dir(builtin)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if show_progress:
        Console().print(
            f"Building the demo model builtin:{builtin} into {final} "
            "(first use only; about a minute on 2 CPU cores)"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_demo_checkpoint(tmp, seed=0, show_progress=show_progress, **build_args)
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is an ordinary directory
        try:
            tmp.rename(final)
        except OSError as e:
            if not (final / "config.json").is_file():
                raise ValueError(
                    f"cannot create the demo checkpoint at {final}: the path exists but holds no "
                    f"checkpoint; remove it (or set RLTOOL_CACHE elsewhere) and retry"
                ) from e
            # else another process finished first: keep its checkpoint, drop ours
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def ensure_builtin_models(*paths: str | None, show_progress: bool = True) -> None:
    """Build every ``builtin:<name>`` among ``paths`` that is not in the cache yet."""
    for path in paths:
        if is_builtin(path):
            ensure_demo_checkpoint(show_progress, builtin=check_builtin_model(path))


if __name__ == "__main__":  # python -m rltool.app.demo_model: build every builtin checkpoint
    for name in BUILD_ARGS:
        try:
            print(ensure_demo_checkpoint(builtin=name))
        except ValueError as exc:  # tiny-rg-sums without the reasoning-gym extra: say so
            print(f"builtin:{name} not built: {exc}")

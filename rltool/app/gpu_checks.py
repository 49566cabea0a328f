"""The checks of ``scripts/gpu_check.sh``: every path written for CUDA, run on a tiny model.

Each check is ``fn(device) -> (figure, ok)``; it raises ``Skipped`` when this machine cannot
run it (no CUDA, no flash-attn). ``device`` is "cuda" on a GPU machine; checks that also run
on the CPU (bf16, activation checkpointing, the HF engine) take "cpu" there, which is how the
fast tests run them. Shape legend: N = positions of a packed row, P = parameters.
"""

from __future__ import annotations

import copy
import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from rltool.app.gpu_check import DEMO_STEPS
from rltool.training.attention import FLASH_VARLEN, FLEX_BLOCK, SDPA_TREE, SDPA_VARLEN
from rltool.training.batch import Pack

VOCAB = 101
DEMO_TIMEOUT_S = 360  # the whole script must stay under 8 minutes


class Skipped(Exception):
    """This machine cannot run the check (the message says why)."""


def need_cuda(device: str) -> None:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise Skipped("no CUDA")


def usable(device: str) -> str:
    """``device`` for a check that also runs on the CPU; CUDA asked for and absent: Skipped
    (the ``cuda`` check is the one that fails then)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Skipped("no CUDA")
    return device


def check_cuda(device: str) -> tuple[str, bool]:
    """The GPU the other checks run on (a failure when CUDA was asked for and is absent)."""
    if not device.startswith("cuda"):
        raise Skipped(f"device {device}")
    if not torch.cuda.is_available():
        return f"no CUDA device visible (torch {torch.__version__})", False
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    return f"{name}, sm_{major}{minor}, torch {torch.__version__}", True


def tiny_model(
    attn: str = "sdpa", vocab: int = VOCAB, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A 2-layer Qwen2 whose weights depend only on ``seed`` (built on the CPU); head size 32,
    which every kernel here (flex_attention's Triton, flash-attn) supports."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        initializer_range=0.1,  # logits far from uniform, so precision and kernels show
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)


def grpo_rows() -> list[Pack]:
    """Two prompts x 3 responses in two plain rows, each sample with its own advantage."""
    g = torch.Generator().manual_seed(5)
    samples = []
    for prompt_len in (12, 9):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g)
        for k in range(3):
            seq = torch.cat([prompt, torch.randint(1, VOCAB, (4 + 3 * k,), generator=g)])
            targets = torch.cat([torch.full((prompt_len - 1,), -100), seq[prompt_len:]])
            samples.append((seq[:-1], targets, float(k - 1)))

    def pack(idx: list[int]) -> Pack:
        lens = [len(samples[i][0]) for i in idx]
        targets = torch.cat([samples[i][1] for i in idx])
        adv = torch.cat([torch.full((n,), samples[i][2]) for i, n in zip(idx, lens, strict=True)])
        return Pack(
            input_ids=torch.cat([samples[i][0] for i in idx]),
            targets=targets,
            advantages=torch.where(targets != -100, adv, 0.0),
            rollout_logprobs=torch.zeros(len(targets)),
            has_rollout_logprobs=torch.ones(len(targets), dtype=torch.bool),
            position_ids=torch.cat([torch.arange(m) for m in lens]),
            cu_seq_lens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]).int(),
            max_seq_len=max(lens),
            sample_index=idx,
        )

    return [pack([0, 3, 4]), pack([1, 2, 5])]


def shared_rows(attention: str) -> list[Pack]:
    from rltool.training.layout.shared_prefix import share_prefixes

    return share_prefixes(grpo_rows(), max_len=128, attention=attention).packs


def train_step(model: torch.nn.Module, packs: list[Pack]) -> tuple[float, torch.Tensor]:
    """(loss, every gradient flattened [P] in float32) of a policy-gradient loss summed over
    the rows: -sum(advantage * logprob) / loss tokens, as a REINFORCE step."""
    from rltool.training.logprobs import forward_logprobs

    model.zero_grad(set_to_none=True)
    tokens = sum(int((p.targets != -100).sum()) for p in packs)
    total = 0.0
    for pack in packs:
        logp, _ = forward_logprobs(model, pack, temperature=1.0, with_entropy=False)  # [N]
        adv = pack.advantages.to(logp.device)  # [N]
        loss = -(adv * logp).sum() / tokens
        loss.backward()
        total += loss.item()
    grads = [_full(p.grad).float().flatten().cpu() for p in model.parameters()]
    return total, torch.cat(grads)  # [P]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor under FSDP2


def compare(
    ref: tuple[float, torch.Tensor], got: tuple[float, torch.Tensor]
) -> tuple[float, float]:
    """(relative loss difference, cosine similarity of the gradients)."""
    loss_rel = abs(got[0] - ref[0]) / max(abs(ref[0]), 1e-8)
    cos = float(torch.nn.functional.cosine_similarity(ref[1], got[1], dim=0))
    return loss_rel, cos


def _figure(loss_rel: float, cos: float) -> str:
    return f"loss rel diff {loss_rel:.1e}, grad cos {cos:.6f}"


def check_bf16(device: str) -> tuple[str, bool]:
    """``model.dtype: bfloat16``: the train step in bf16 against fp32, same weights."""
    device = usable(device)
    ref_model = tiny_model().to(device)
    bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
    loss_rel, cos = compare(train_step(ref_model, grpo_rows()), train_step(bf16, grpo_rows()))
    return _figure(loss_rel, cos), loss_rel < 3e-2 and cos > 0.98


def _kernel_pair(device: str, ref_model, model, ref_packs, packs, tight: bool) -> tuple[str, bool]:
    loss_rel, cos = compare(train_step(ref_model, ref_packs), train_step(model, packs))
    # tight: one fp32 computation by two kernels (a wrong mask moves the loss by > 1e-2)
    ok = loss_rel < 1e-3 and cos > 0.9999 if tight else loss_rel < 3e-2 and cos > 0.98
    return _figure(loss_rel, cos), ok


def check_flex_block(device: str) -> tuple[str, bool]:
    """Shared-prefix rows with flex_attention's BlockMask against sdpa-tree, fp32."""
    need_cuda(device)
    model = tiny_model().to(device)
    flex = [replace(p, attention=FLEX_BLOCK) for p in shared_rows(SDPA_TREE)]
    return _kernel_pair(device, model, model, shared_rows(SDPA_TREE), flex, tight=True)


def check_flash_varlen(device: str) -> tuple[str, bool]:
    """Plain rows with flash-attn's variable-length kernel against sdpa-varlen, both bf16
    (flash-attn computes in half precision only)."""
    need_cuda(device)
    if importlib.util.find_spec("flash_attn") is None:
        raise Skipped("flash-attn not installed")
    ref = tiny_model("sdpa", dtype=torch.bfloat16).to(device)
    flash = tiny_model("flash_attention_2", dtype=torch.bfloat16).to(device)
    plain = [replace(p, attention=FLASH_VARLEN) for p in grpo_rows()]
    sdpa = [replace(p, attention=SDPA_VARLEN) for p in grpo_rows()]
    return _kernel_pair(device, ref, flash, sdpa, plain, tight=False)


def check_activation_checkpointing(device: str) -> tuple[str, bool]:
    """Hugging Face's non-reentrant gradient checkpointing (``distributed.activation_
    checkpointing``) gives the same loss and gradients as keeping activations, fp32."""
    device = usable(device)
    ref = tiny_model().to(device).train()
    ckpt = copy.deepcopy(ref)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _kernel_pair(device, ref, ckpt, grpo_rows(), grpo_rows(), tight=True)


def check_fsdp2_nccl(device: str) -> tuple[str, bool]:
    """FSDP2 (``shard_model``) on a one-process NCCL group with bf16 mixed precision and
    activation checkpointing, against the unsharded fp32 step."""
    need_cuda(device)
    import torch.distributed as dist

    from rltool.config.schema import DistributedConfig
    from rltool.training.sharding import shard_model

    torch.cuda.set_device(0)
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ref = tiny_model().to(device)
        cfg = DistributedConfig(mixed_precision="bf16", activation_checkpointing=True)
        sharded = shard_model(copy.deepcopy(ref).train(), cfg)
        loss_rel, cos = compare(train_step(ref, grpo_rows()), train_step(sharded, grpo_rows()))
        probe = torch.ones(3, device=device)
        dist.all_reduce(probe)  # the collective the metric sums use
    finally:
        dist.destroy_process_group()
    ok = loss_rel < 3e-2 and cos > 0.98 and float(probe.sum()) == 3.0
    return _figure(loss_rel, cos), ok


def check_hf_engine(device: str) -> tuple[str, bool]:
    """The HF engine generates on ``device``; the trainer's logprobs of its tokens match
    the engine's (the rollout correction reads their difference)."""
    device = usable(device)
    from rltool.config.schema import SamplingConfig
    from rltool.demo.data import GSM8K_TINY_DIR, read_jsonl
    from rltool.demo.tokenizer import train_demo_tokenizer
    from rltool.engines.hf import HFEngine
    from rltool.training.logprobs import forward_logprobs

    tok = train_demo_tokenizer()
    model = tiny_model(vocab=len(tok)).to(device).eval()
    problems = read_jsonl(GSM8K_TINY_DIR / "test.jsonl")[:6]
    prompts = [tok(p.question, add_special_tokens=False)["input_ids"] for p in problems]
    torch.manual_seed(0)
    gens = HFEngine(model, tok, batch_size=8).generate(
        prompts, SamplingConfig(temperature=1.0, max_new_tokens=16)
    )
    worst, count = 0.0, 0
    with torch.no_grad():
        for prompt, gen in zip(prompts, gens, strict=True):
            seq = torch.tensor(prompt + gen.token_ids)
            targets = torch.cat([torch.full((len(prompt) - 1,), -100), seq[len(prompt) :]])
            n = len(seq) - 1
            pack = Pack(
                input_ids=seq[:-1],
                targets=targets,
                advantages=torch.zeros(n),
                rollout_logprobs=torch.zeros(n),
                has_rollout_logprobs=torch.ones(n, dtype=torch.bool),
                position_ids=torch.arange(n),
                cu_seq_lens=torch.tensor([0, n]).int(),
                max_seq_len=n,
                sample_index=[0],
            )
            logp, _ = forward_logprobs(model, pack, temperature=1.0, with_entropy=False)
            trainer = logp[len(prompt) - 1 :].cpu()  # [R]
            diff = (trainer - torch.tensor(gen.logprobs)).abs()
            worst, count = max(worst, float(diff.max()) if len(diff) else 0.0), count + len(diff)
    return f"max |logprob diff| {worst:.1e} over {count} tokens", count > 0 and worst < 1e-3


def check_demo(device: str) -> tuple[str, bool]:
    """`rltool train recipes/gsm8k_tiny.yaml` for 20 steps on the GPU: it ends cleanly and
    the held-out accuracy at step 20 is not below step 0's."""
    need_cuda(device)
    return run_demo(device, DEMO_STEPS, eval_every=10)


def run_demo(device: str, steps: int, eval_every: int, *extra: str) -> tuple[str, bool]:
    """The demo recipe for ``steps`` steps on ``device`` in a fresh run directory; ``extra``
    overrides go last (the fast tests shrink the evaluation)."""
    from rltool import metric_names as mn
    from rltool.app.run_reader import read_run, series

    out = Path(tempfile.mkdtemp(prefix="rltool-gpu-check-"))
    recipe = out / "gsm8k_tiny.yaml"  # recipes/gsm8k_tiny.yaml, found from any directory
    recipe.write_text("defaults: [demo/gsm8k_tiny]\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "rltool.cli.app", "train", str(recipe),
           f"trainer.steps={steps}", f"trainer.eval_every={eval_every}",
           "trainer.time_budget_s=null", f"model.device={device}",
           f"logging.run_dir={out}", "logging.name=demo", *extra]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    took = time.monotonic() - start
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        return f"rltool train exited {done.returncode} after {took:.0f} s", False
    acc = series(read_run(out / "demo"), "eval", mn.EVAL_ACCURACY)
    pairs = [(s, v) for s, v in zip(acc.steps, acc.values, strict=True) if v is not None]
    if len(pairs) < 2:
        return f"{len(pairs)} evaluations in {out}", False
    (s0, a0), (s1, a1) = pairs[0], pairs[-1]
    figure = f"held-out {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1}), {took:.0f} s"
    return figure, s1 == steps and a1 >= a0

"""Training-step throughput on 1 process and on N FSDP2 processes: tokens per second, ratio.

    python benchmarks/scaling.py                      # 1 process vs 2 (gloo on the CPU)
    python benchmarks/scaling.py --nproc 2 --rows 8 --row-len 1024 --steps 3

Both sides train the same demo-sized Qwen2 (hidden 256, 4 layers) on the same packed rows
with ``PolicyUpdater.step`` (on-policy GRPO loss, AdamW); the N-process side shards it with
``fully_shard`` and splits the rows by token count, as ``rltool train`` does. The script
launches that side itself through torch.distributed.run (NCCL on a GPU, one GPU a
process) and reads its figure back. On the CPU each of the N processes gets 1/N of the
cores; the one-process side is measured with every core and with 1/N of them (on a busy
machine, OpenMP threads that oversubscribe the cores can slow one process many times).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rltool.config.schema import AlgorithmConfig, DistributedConfig, OptimizerConfig
from rltool.training.batch import Pack
from rltool.training.optim import build_optimizer, build_scheduler
from rltool.training.sharding import Shard, close_shard, init_shard, shard_model
from rltool.training.updater import PolicyUpdater

VOCAB = 491
SAMPLE_LEN = 256  # tokens per sample; a row holds row_len / SAMPLE_LEN samples
MARK = "SCALING "


def model_for(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SAMPLE_LEN,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg).to(device)


def rows(n: int, row_len: int) -> list[Pack]:
    g = torch.Generator().manual_seed(1)
    per_row = row_len // SAMPLE_LEN
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (per_row * SAMPLE_LEN,), generator=g)
        targets = torch.randint(1, VOCAB, (per_row * SAMPLE_LEN,), generator=g)
        targets.view(per_row, SAMPLE_LEN)[:, :32] = -100  # a 32-token prompt per sample
        advantages = torch.randn(per_row, generator=g).repeat_interleave(SAMPLE_LEN)
        out.append(
            Pack(
                input_ids=ids,
                targets=targets,
                advantages=advantages * (targets != -100),
                rollout_logprobs=torch.zeros(len(ids)),
                has_rollout_logprobs=torch.zeros(len(ids), dtype=torch.bool),
                position_ids=torch.arange(SAMPLE_LEN).repeat(per_row),
                cu_seq_lens=torch.arange(0, len(ids) + 1, SAMPLE_LEN, dtype=torch.int32),
                max_seq_len=SAMPLE_LEN,
                sample_index=list(range(per_row)),
            )
        )
    return out


def tokens_per_s(args: argparse.Namespace, shard: Shard | None) -> float:
    """Tokens of every row (all ranks together) per second of ``PolicyUpdater.step``."""
    device = shard.device if shard else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model_for(device)
    if shard is not None:
        shard_model(model, DistributedConfig())
    cfg = OptimizerConfig(lr=1e-6)
    optimizer = build_optimizer(model, cfg)
    algo = AlgorithmConfig(tis_cap=None)
    updater = PolicyUpdater(
        model, optimizer, build_scheduler(optimizer, cfg, 100), algo, shard=shard
    )
    packs = rows(args.rows, args.row_len)
    updater.step(packs)  # warm-up: allocator, kernels, FSDP's first all-gathers
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        updater.step(packs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return args.steps * sum(len(p) for p in packs) / (time.perf_counter() - t0)


def sharded_side(args: argparse.Namespace) -> float:
    """Launch this script on ``--nproc`` processes; their tokens/s."""
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={args.nproc}", __file__, *sys.argv[1:]]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    figures = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not figures:
        raise SystemExit(f"the {args.nproc}-process run failed:\n{done.stderr[-3000:]}")
    return json.loads(figures[-1][len(MARK) :])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="packed rows a step")
    parser.add_argument("--row-len", type=int, default=1024, help="tokens a row")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after 1 warm-up)")
    args = parser.parse_args()
    shard = init_shard(DistributedConfig())
    if shard is not None:  # a rank of the N-process side
        figure = tokens_per_s(args, shard)
        if shard.leader:
            print(MARK + json.dumps({"tokens_per_s": figure}), flush=True)
        close_shard(shard)
        return
    where = "cuda" if torch.cuda.is_available() else f"cpu, {os.cpu_count()} cores"
    print(f"training step, {args.rows} rows x {args.row_len} tokens, {where}")
    cores = os.cpu_count() or 1
    one = tokens_per_s(args, None)
    print(f"  1 process, {torch.get_num_threads()} threads      {one:10.0f} tokens/s")
    slim = None
    if not torch.cuda.is_available() and cores // args.nproc != torch.get_num_threads():
        torch.set_num_threads(max(1, cores // args.nproc))
        slim = tokens_per_s(args, None)
        print(f"  1 process, {torch.get_num_threads()} threads      {slim:10.0f} tokens/s")
    if torch.cuda.is_available() and torch.cuda.device_count() < args.nproc:
        print(
            f"  {args.nproc} processes: needs {args.nproc} GPUs (one a process), found "
            f"{torch.cuda.device_count()}"
        )
        return
    many = sharded_side(args)
    print(f"  {args.nproc} processes (FSDP2)      {many:10.0f} tokens/s")
    print(f"  ratio {args.nproc} processes / 1 process: {many / one:.2f}x")
    if slim is not None:
        print(
            f"  ratio {args.nproc} processes / 1 process on 1/{args.nproc} of the cores: "
            f"{many / slim:.2f}x"
        )


if __name__ == "__main__":
    main()

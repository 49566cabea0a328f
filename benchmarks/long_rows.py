"""Long rows: one training step at row lengths 2k to 16k (32k with --lengths), prefix
sharing off and on, through the kernels conversion picks (no [N, N] mask) against
today's dense-mask path.

Per row length N and layout it prints the step time per row token (ms/tok) and per
token the samples hold laid out plain (ms/stok: a shared row stands for 2.5 N), the peak memory of
the step above its start and the largest single allocation, both read from the torch
profiler's allocation events, the largest allocation as a fraction of an [N, N] matrix of
1-byte (bool mask) and 4-byte (fp32) elements, and the growth of the peak per doubling of
N. The largest allocation is an MLP activation ([N, 688] fp32): it is above N*N bytes
below N = 2752 and halves against N*N with each doubling; the step fails if one reaches
N*N*4 bytes. The dense baseline
runs up to --baseline-max (its [N, N] mask is what the kernels remove); the ratio
columns are dense / ours.

Rows (hidden 256, 2 layers, 4 heads of 64, vocabulary 256, fp32, AdamW):
- plain: 4 samples of N/4 positions (prompt N/8, response N/8) back to back;
- shared: one prompt of N/2 positions and 4 responses of N/8 as branches (the same
  samples laid out plain would take 2.5 N positions).

    python benchmarks/long_rows.py                            # 2k 4k 8k 16k, dense to 8k
    python benchmarks/long_rows.py --lengths 2048 4096 8192 16384 32768
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, Qwen2Config

from rltool.config.schema import AlgorithmConfig, OptimizerConfig
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status
from rltool.training.attention import DENSE, NATIVE, choose_kernels
from rltool.training.batch import Pack
from rltool.training.convert import ConversionConfig, convert_groups
from rltool.training.layout.shared_prefix import share_prefixes
from rltool.training.optim import build_optimizer, build_scheduler
from rltool.training.updater import PolicyUpdater

VOCAB = 256


def tiny_model(max_len: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def sample(rid: str, prompt: list[int], response: list[int], score: float) -> RolloutState:
    return RolloutState(
        rollout_id=rid,
        group_id="g",
        prompt_ids=prompt,
        response_ids=response,
        input_ids=prompt + response,
        labels=[IGNORE_INDEX] * len(prompt) + response,
        logprobs=[0.0] * len(prompt) + [-1.0] * len(response),
        reward={"score": score},
        status=Status.COMPLETED,
    )


def rows(n: int, shared: bool) -> list[Pack]:
    """One row of n positions, laid out by the conversion's layout functions."""
    g = torch.Generator().manual_seed(n)

    def tokens(k: int) -> list[int]:
        return torch.randint(1, VOCAB, (k,), generator=g).tolist()

    kernels = choose_kernels("sdpa", "cpu")
    if shared:  # prefix n/2 (the prompt less its last token), branches n/8
        prompt = tokens(n // 2 + 1)
        group = [sample(f"s{i}", prompt, tokens(n // 8), float(i)) for i in range(4)]
    else:  # 4 samples of n/4 shifted positions
        group = [sample(f"s{i}", tokens(n // 8), tokens(n // 8 + 1), float(i)) for i in range(4)]
    cfg = ConversionConfig(pack_max_length=n, prefix_sharing=False)
    packs = convert_groups([group], cfg).packs
    if shared:
        packs = list(share_prefixes(packs, max_len=n, attention=kernels[1]).packs)
    assert len(packs) == 1 and len(packs[0]) == n, [len(p) for p in packs]
    return packs


def dense(packs: list[Pack]) -> list[Pack]:
    """Today's path: transformers' own mask (plain rows) or the explicit [N, N] mask."""
    return [
        dataclasses.replace(p, attention=DENSE if hasattr(p, "tree_ids") else NATIVE) for p in packs
    ]


def updater_for(n: int) -> PolicyUpdater:
    model = tiny_model(n)
    opt_cfg = OptimizerConfig(lr=1e-4)
    opt = build_optimizer(model, opt_cfg)
    return PolicyUpdater(model, opt, build_scheduler(opt, opt_cfg, 10), AlgorithmConfig())


def measure(packs: list[Pack], n: int) -> dict[str, float]:
    """One step on a fresh model, profiled: its seconds, its peak bytes above its start and
    its largest allocation, from the profiler's allocation events."""
    updater = updater_for(n)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        updater.step(packs)
        seconds = time.perf_counter() - t0
    allocs: list[tuple[int, int, int]] = []  # (time, size, total allocated after)

    def walk(node) -> None:
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            allocs.append((node.start_time_ns, f.alloc_size, f.total_allocated))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    allocs.sort()
    start = allocs[0][2] - allocs[0][1]
    peak = max(total for _, _, total in allocs) - start
    return {"s": seconds, "peak": peak, "largest": max(size for _, size, _ in allocs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--baseline-max", type=int, default=8192, help="longest dense-mask row")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mb = 2**20
    print(
        f"{'layout':7} {'N':>6} {'ms/tok':>7} {'ms/stok':>7} {'peak MB':>8} {'x/doubl':>7} "
        f"{'largest MB':>10} {'/N*N*1':>7} {'/N*N*4':>7} | {'dense ms/tok':>12} "
        f"{'peak MB':>8} {'largest MB':>10} {'time x':>6} {'peak x':>6}"
    )
    for warm_up in (False, True):  # first calls (allocator, kernels) out of the figures
        packs = rows(512, warm_up)
        measure(packs, 512)
        measure(dense(packs), 512)
    for shared in (False, True):
        layout = "shared" if shared else "plain"
        per = 2.5 if shared else 1.0  # positions the samples take in plain rows, per row one
        last_peak = None
        for n in args.lengths:
            packs = rows(n, shared)
            ours = measure(packs, n)
            growth = f"{ours['peak'] / last_peak:7.2f}" if last_peak else f"{'':7}"
            last_peak = ours["peak"]
            line = (
                f"{layout:7} {n:>6} {1e3 * ours['s'] / n:7.3f} {1e3 * ours['s'] / (n * per):7.3f} "
                f"{ours['peak'] / mb:8.1f} {growth} "
                f"{ours['largest'] / mb:10.1f} {ours['largest'] / n**2:7.3f} "
                f"{ours['largest'] / (4 * n**2):7.3f} |"
            )
            assert ours["largest"] < 4 * n * n, f"an allocation of N*N fp32 at N={n}"
            if n <= args.baseline_max:
                base = measure(dense(packs), n)
                line += (
                    f" {1e3 * base['s'] / n:12.3f} {base['peak'] / mb:8.1f} "
                    f"{base['largest'] / mb:10.1f} {base['s'] / ours['s']:6.2f} "
                    f"{base['peak'] / ours['peak']:6.2f}"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()

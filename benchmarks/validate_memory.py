"""Memory and speed of ``rltool validate-rollouts`` on a big rollout file.

Writes a JSONL of valid rollouts (~1 GB by default, under /tmp), runs
``rltool validate-rollouts --format json`` on it in a subprocess and prints
wall time, samples/s, MB/s and the child's peak RSS. Validation streams the
file, so the peak RSS must stay far below the file size. The file is deleted
afterwards unless ``--keep``.

    python benchmarks/validate_memory.py --size-gb 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rltool.rollout.state import RolloutState, Status

_RID, _GID = "@@RID@@", "@@GID@@"
GROUP_SIZE = 8
PROMPT_LEN = 256
RESPONSE_LENS = (384, 768, 1024, 1536)  # a few template lengths, T = P + R


def _template(response_len: int, rng: random.Random) -> tuple[str, str, str]:
    """A valid sample as JSON, split around its rollout_id and group_id values.

    The response has a tool segment (unsupervised, logprob 0.0) in the middle,
    and model steps that increase once, like a partial rollout.
    """
    prompt = [rng.randrange(5, 50_000) for _ in range(PROMPT_LEN)]
    response = [rng.randrange(5, 50_000) for _ in range(response_len)]
    tool = range(response_len // 3, response_len // 3 + 32)
    labels = [-100] * PROMPT_LEN + [-100 if i in tool else t for i, t in enumerate(response)]
    logprobs = [0.0] * PROMPT_LEN + [
        0.0 if i in tool else math.log(rng.uniform(0.05, 1.0)) for i in range(response_len)
    ]
    half = response_len // 2
    sample = RolloutState(
        rollout_id=_RID,
        group_id=_GID,
        task_name="bench",
        agent_loop="gsm8k",
        prompt_ids=prompt,
        response_ids=response,
        input_ids=prompt + response,
        labels=labels,
        logprobs=logprobs,
        response_model_steps=[3] * half + [4] * (response_len - half),
        reward={"score": 1.0},
        status=Status.COMPLETED,
        finish_reason="stop",
    )
    line = sample.to_json() + "\n"
    head, rest = line.split(_RID, 1)
    mid, tail = rest.split(_GID, 1)
    return head, mid, tail


def write_file(path: Path, size_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Write whole groups of valid samples until ``size_bytes``; returns (samples, bytes)."""
    rng = random.Random(seed)
    templates = [_template(r, rng) for r in RESPONSE_LENS]
    samples = written = 0
    with path.open("w", encoding="utf-8") as f:
        group = 0
        while written < size_bytes:
            head, mid, tail = templates[group % len(templates)]
            gid = f"g{group:09d}"
            chunk = "".join(
                f"{head}{gid}-{k}{mid}{gid}{tail}" for k in range(GROUP_SIZE)
            )  # rollout_id = group id + member index: unique
            f.write(chunk)
            written += len(chunk)
            samples += GROUP_SIZE
            group += 1
    return samples, written


def run_validate(path: Path) -> tuple[float, int, dict[str, object]]:
    """(wall seconds, exit code, parsed JSON report) of the CLI on ``path``."""
    cmd = [
        sys.executable,
        "-c",
        "from rltool.cli.app import main; main()",
        "validate-rollouts",
        "--format",
        "json",
        str(path),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"validate-rollouts exited {proc.returncode}: {proc.stderr.strip()}")
    return wall, proc.returncode, json.loads(proc.stdout)


def _child_usage() -> tuple[int, float]:
    """(peak RSS in bytes, CPU seconds) over all children waited for so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime  # Linux: ru_maxrss in KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--keep", action="store_true", help="keep the generated file")
    args = parser.parse_args()

    path = args.dir / f"rltool_validate_bench_{args.size_gb:g}gb.jsonl"
    try:
        # Baseline first: the CLI on one group (interpreter + imports). RUSAGE_CHILDREN
        # keeps the max over children, so the second reading is the big run's peak.
        write_file(path, 1)
        run_validate(path)
        base_rss, base_cpu = _child_usage()
        start = time.perf_counter()
        samples, size = write_file(path, int(args.size_gb * (1 << 30)))
        took = time.perf_counter() - start
        print(f"wrote {samples} samples, {size / 1e6:.0f} MB in {took:.1f} s to {path}")
        wall, code, report = run_validate(path)
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
    peak, cpu = _child_usage()
    cpu -= base_cpu
    print(f"exit code        {code} ({report['errors']} errors, {report['warnings']} warnings)")
    print(f"samples checked  {report['samples']} in {report['groups']} groups")
    print(f"wall time        {wall:.1f} s (CPU {cpu:.1f} s)")
    rate = report["samples"] / wall
    print(f"throughput       {rate:,.0f} samples/s, {size / 1e6 / wall:.1f} MB/s (wall)")
    print(
        f"peak RSS (child) {peak / 1e6:.0f} MB = {peak / size:.1%} of the file size; "
        f"baseline on one group {base_rss / 1e6:.0f} MB (+{(peak - base_rss) / 1e6:.0f} MB)"
    )
    if report["samples"] != samples or code != 0:
        raise SystemExit("validation did not see every sample as clean")


if __name__ == "__main__":
    main()

"""Write a verifiers environment's tasks as rltool data records (JSONL), one per task:
``question`` (the prompt text), ``answer`` and ``vf_task`` (the task's wire data, which the
verifiers loop rebuilds the task from). The taskset's own config picks the split.

    python scripts/verifiers_tasks.py vf_arith --env-dir recipes/envs/vf_arith \
        --set split=train --set size=64 --out rltool/demo/data/vf_arith/train.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rltool.agent_loops.verifiers_env import add_env_dir, task_records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("environment", help="the verifiers environment (its module name)")
    parser.add_argument("--env-dir", default="", help="directory holding it, if not installed")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a taskset config field (value parsed as JSON, else a string)",
    )
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    config = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: use KEY=VALUE")
        try:
            config[key] = json.loads(value)
        except ValueError:
            config[key] = value
    add_env_dir(args.env_dir)
    records = task_records(args.environment, config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    print(f"{args.out}: {len(records)} tasks of {args.environment}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

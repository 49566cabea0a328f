"""The Typer app. Thin: each command lives in its own module and calls library code."""

from __future__ import annotations

import typer

from rltool.cli import eval, export, inspect_batch, replay, report, train, validate

app = typer.Typer(
    name="rltool",
    help="Reinforcement-learning post-training of language models, driven by YAML recipes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("train")(train.train)
app.command("validate-rollouts")(validate.validate_rollouts)
app.command("inspect-batch")(inspect_batch.inspect_batch)
app.command("eval")(eval.eval_command)
app.command("export")(export.export_command)
app.command("report")(report.report_command)
app.command("replay")(replay.replay_command)


def main() -> None:
    app()


if __name__ == "__main__":  # python -m rltool.cli.app: how torch.distributed.run starts ranks
    main()

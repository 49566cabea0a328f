"""``rltool inspect-batch FILE``: convert rollouts exactly as training would and show the result.

The groups come from a rollout JSONL file (or, for a recipe ``.yaml``, from one
step of the recipe's generation). When a staleness limit is given, stale tokens are
first marked as not trained by the replay buffer's own function (``bake_group``:
labels cleared, expired samples marked EXPIRED); it reports the positions it
cleared, so the view tells stale tokens from tokens never supervised. The
groups are then converted by ``convert_groups``, the one conversion training
uses, into the row layout the updater trains on (``--prefix-sharing``), and the
TrainBatch is rendered (``rltool.report.inspect_view``) or printed as JSON
(``rltool.report.batch_json``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import numpy as np
import typer
from rich.text import Text

from rltool.cli.inspect_mismatch import MismatchView, mismatch_view, show_mismatch
from rltool.config.loader import load_recipe
from rltool.config.schema import RecipeConfig
from rltool.metric_names import EXPIRED_SAMPLES, STALE_TOKENS
from rltool.report.batch_json import batch_to_json
from rltool.report.console import make_console
from rltool.report.inspect_view import Decoder, render_batch, tokenizer_decoder
from rltool.report.routing_view import parse_routing_request, render_routing, routing_of_token
from rltool.rollout.foreign import describe_foreign
from rltool.rollout.io import not_a_file_reason, read_groups
from rltool.rollout.staleness import StalenessLimits, bake_group
from rltool.rollout.state import RolloutState, Status, group_status
from rltool.training.batch import TrainBatch
from rltool.training.convert import ConversionConfig, convert_groups

RECIPE_SUFFIXES = (".yaml", ".yml")
Settings = TypeVar("Settings", ConversionConfig, StalenessLimits)


class OutputFormat(StrEnum):
    RICH = "rich"
    JSON = "json"


class Switch(StrEnum):
    ON = "on"
    OFF = "off"


@dataclass(slots=True)
class GroupSource:
    """Where a batch's groups come from, with what the source knows about converting them."""

    groups: list[list[RolloutState]]
    conversion: ConversionConfig
    staleness: StalenessLimits
    train_step: int
    tokenizer: Any = None  # a Hugging Face tokenizer, or None: ids are shown


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _check_regular(path: Path) -> None:
    """A FIFO or device is refused before anything opens it (reading one would wait)."""
    reason = not_a_file_reason(path.stat().st_mode)
    if reason is not None:
        raise UserError(f"{path}: {reason}", 2)


def _warn_foreign(path: Path) -> Callable[[int, str, RolloutState], None]:
    """Another framework's field, once per name: the sample is shown, the field noted."""
    console = make_console(stderr=True)

    def warn(line_no: int, name: str, sample: RolloutState) -> None:
        message = f" {path}:{line_no}: {describe_foreign(name)}"
        console.print(Text.assemble(("warning:", "warning"), message))

    return warn


def next_train_step(groups: list[list[RolloutState]]) -> int:
    """The step that would train these samples next: the newest model step + 1 (0 when
    no sample records model steps), so that no token shows a negative staleness."""
    steps = [int(s.response_model_steps.max()) for g in groups for s in g if _has_steps(s)]
    return max(steps) + 1 if steps else 0


def _has_steps(s: RolloutState) -> bool:
    return s.response_model_steps is not None and len(s.response_model_steps) > 0


def _groups_from_file(path: Path) -> GroupSource:
    try:
        groups = read_groups(path, on_foreign=_warn_foreign(path))
    except ValueError as exc:  # a bad line, named with file and line by read_groups
        raise UserError(str(exc), 1) from exc
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})", 2) from exc
    if not groups:
        raise UserError(f"{path}: no samples", 1)
    recipe = RecipeConfig()
    conversion = ConversionConfig.from_recipe(recipe)
    staleness = StalenessLimits.from_algorithm(recipe.algorithm)
    return GroupSource(groups, conversion, staleness, next_train_step(groups))


def _groups_from_recipe(path: Path, overrides: list[str]) -> GroupSource:
    """One step of the recipe's generation (its model, loop and conversion settings)."""
    from rltool.app.run import generate_batch_from_recipe  # loads the model stack: on demand

    try:
        recipe = load_recipe(path, overrides)
        groups, tokenizer, conversion, train_step = generate_batch_from_recipe(str(path), overrides)
    except (ValueError, FileNotFoundError) as exc:  # a bad recipe, override or data file
        raise UserError(f"{path}: {exc}", 2) from exc
    staleness = StalenessLimits.from_algorithm(recipe.algorithm)
    return GroupSource(groups, conversion, staleness, train_step, tokenizer)


def _load_tokenizer(path: Path) -> Any:
    """A local tokenizer: a ``tokenizer.json`` file or a Hugging Face tokenizer directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a tokenizer from {path}: {exc}", 2) from exc


def select_samples(batch: TrainBatch, sample: str | None, limit: int | None) -> list[int]:
    """Indices into ``batch.samples``: only the rollout_id ``sample`` if given, then the first
    ``limit``."""
    indices = list(range(len(batch.samples)))
    if sample is not None:
        indices = [i for i in indices if batch.samples[i].rollout_id == sample]
        if not indices:
            raise UserError(_missing_sample_message(batch, sample), 1)
    return indices if limit is None else indices[:limit]


def _missing_sample_message(batch: TrainBatch, rollout_id: str) -> str:
    skipped = ", ".join(f"{g.group_id} ({g.reason})" for g in batch.skipped_groups)
    where = f"; skipped groups: {skipped}" if skipped else ""
    return f"--sample {rollout_id}: no such sample in the batch{where}"


# the recipe key each option stands for: checked by the recipe's own rules
OPTION_KEYS = {
    "estimator": "algorithm.estimator",
    "pack_max_length": "trainer.pack_max_length",
    "max_staleness": "algorithm.max_staleness",
    "max_token_staleness": "algorithm.max_token_staleness",
    "sync_interval": "algorithm.sync_interval",
}


def _with_options(settings: Settings, options: dict[str, Any]) -> Settings:
    """A settings dataclass with the options the user gave (None = not given)."""
    from rltool.app.recipe_names import option_problem

    given = {k: v for k, v in options.items() if v is not None}
    checked = [(OPTION_KEYS[k], v) for k, v in given.items() if k in OPTION_KEYS]
    problems = [p for key, v in checked if (p := option_problem(key, v))]
    if problems:
        raise UserError(f"bad option: {'; '.join(problems)}", 2)
    return dataclasses.replace(settings, **given)


@dataclass(slots=True)
class BakeResult:
    stale: dict[str, np.ndarray]  # rollout_id -> [T] positions whose labels were cleared
    cleared: int  # supervised tokens cleared
    expired: int  # samples of the groups that expired (not trained), as the producer counts


def _mismatch_view(
    batch: TrainBatch, indices: list[int], model: Path, replay: bool | None, correction: str | None
) -> MismatchView:
    try:
        return mismatch_view(batch, indices, model, replay, correction)
    except ValueError as exc:  # no checkpoint, not a model, replay without routing
        raise UserError(str(exc), 2) from exc


def bake_groups(
    groups: list[list[RolloutState]], train_step: int, limits: StalenessLimits
) -> BakeResult:
    """The replay buffer's bake (``bake_group``, the same function) on every COMPLETED group,
    in place; only those reach the buffer's take. A member that expires is marked EXPIRED,
    so conversion skips its group as the buffer would not serve it."""
    out = BakeResult({}, 0, 0)
    for group in groups:
        if group_status(s.status for s in group) != Status.COMPLETED:
            continue
        baked = bake_group(group, train_step, limits)
        out.cleared += baked.cleared
        out.expired += len(group) if baked.expired else 0
        for s in group:
            if s.rollout_id in baked.positions:
                stale_T = np.zeros(len(s.labels), dtype=bool)  # [T]
                stale_T[baked.positions[s.rollout_id]] = True
                out.stale[s.rollout_id] = stale_T
    return out


def inspect_batch(
    file: Annotated[
        Path,
        typer.Argument(
            exists=True,
            dir_okay=False,
            help="Rollout JSONL file (a recipe .yaml generates one step with the recipe's model).",
        ),
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Recipe mode only: dotlist overrides (trainer.seed=1 ...)."),
    ] = None,
    estimator: Annotated[
        str | None, typer.Option(help="Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp.")
    ] = None,
    pack_max_length: Annotated[int | None, typer.Option(help="Tokens per packed row.")] = None,
    prefix_sharing: Annotated[
        Switch | None,
        typer.Option(
            help="Row layout: each prompt once per row, its samples as branches (on), or "
            "samples back to back (off). Default: on for a JSONL file, the recipe's value."
        ),
    ] = None,
    train_step: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Train step the batch is for (token staleness). Default for a file: its "
            "newest model step + 1.",
        ),
    ] = None,
    max_staleness: Annotated[
        int | None, typer.Option(help="A sample expires at this staleness (in syncs).")
    ] = None,
    max_token_staleness: Annotated[
        int | None, typer.Option(help="Tokens older than this (in syncs) are cleared.")
    ] = None,
    sync_interval: Annotated[
        int | None, typer.Option(help="Train steps between weight syncs.")
    ] = None,
    sample: Annotated[
        str | None, typer.Option(help="Show only the sample with this rollout_id.")
    ] = None,
    limit: Annotated[int | None, typer.Option(min=0, help="Show only the first N samples.")] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            exists=True, help="Decode tokens with this tokenizer (dir or tokenizer.json)."
        ),
    ] = None,
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="rich: terminal view; json: one object.")
    ] = OutputFormat.RICH,
    routing: Annotated[
        str | None,
        typer.Option(
            help="ROLLOUT_ID:POSITION: show only that input token's MoE experts per layer, "
            "recorded and as its packed row replays them."
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            file_okay=False,
            help="PATH_OR_RUN: recompute the trainer's logprobs with this model directory (or "
            "a run's newest checkpoint) and show them beside the rollout's, token by token.",
        ),
    ] = None,
    replay_routing: Annotated[
        bool | None,
        typer.Option(
            "--replay-routing/--no-replay-routing",
            help="With --model on an MoE model: route the recompute by the recorded experts. "
            "Default: the run's algorithm.routing_replay; off for a model directory.",
        ),
    ] = None,
    rollout_correction: Annotated[
        str | None,
        typer.Option(
            help="With --model: show this correction preset's weights and rejections (token_tis, "
            "seq_tis, seq_mis, geo_rs, k3_rs, icepop) instead of the run's "
            "algorithm.rollout_correction.",
        ),
    ] = None,
) -> None:
    """Convert rollouts exactly as training would and show the packed batch token by token.

    Unset options take the recipe's values in recipe mode; for a JSONL file, the
    recipe defaults (grpo, pack length 2048, prefix sharing on, no staleness limits,
    sync interval 1) and the step after the file's newest model step. Exit code 1: a
    bad line, a file with no samples or a conversion error (e.g. a sample longer than
    --pack-max-length); 2: unusable input (missing, a FIFO or another non-regular file)
    or a bad option.
    """
    is_recipe = file.suffix.lower() in RECIPE_SUFFIXES
    if overrides and not is_recipe:
        raise typer.BadParameter(
            f"overrides {overrides} apply to a recipe .yaml only", param_hint="OVERRIDES"
        )
    sharing = None if prefix_sharing is None else prefix_sharing == Switch.ON
    conversion_options = {
        "estimator": estimator,
        "pack_max_length": pack_max_length,
        "prefix_sharing": sharing,
    }
    staleness_options = {
        "max_staleness": max_staleness,
        "max_token_staleness": max_token_staleness,
        "sync_interval": sync_interval,
    }
    try:
        _check_regular(file)
        source = (
            _groups_from_recipe(file, overrides or []) if is_recipe else _groups_from_file(file)
        )
        step = source.train_step if train_step is None else train_step
        conversion = _with_options(source.conversion, conversion_options)
        baked = bake_groups(source.groups, step, _with_options(source.staleness, staleness_options))
        try:
            batch = convert_groups(source.groups, conversion, step)
        except ValueError as exc:
            raise UserError(f"{file}: {exc}", 1) from exc
        batch.data_info[STALE_TOKENS] = float(baked.cleared)  # the producer's figures
        batch.data_info[EXPIRED_SAMPLES] = float(baked.expired)
        indices = select_samples(batch, sample, limit)
        if routing is not None:
            try:
                token_routing = routing_of_token(
                    batch, source.groups, *parse_routing_request(routing)
                )
            except ValueError as exc:
                raise UserError(str(exc), 1) from exc
        if model is not None:  # the per-token mismatch view (inspect_mismatch.py)
            mismatch = _mismatch_view(batch, indices, model, replay_routing, rollout_correction)
        tok = source.tokenizer
        if tokenizer is not None and output_format == OutputFormat.RICH:
            tok = _load_tokenizer(tokenizer)
    except UserError as exc:
        # Text, not markup: messages hold brackets (field[3], lists)
        make_console(stderr=True).print(Text.assemble(("error:", "error"), f" {exc}"))
        raise typer.Exit(exc.code) from exc
    if model is not None:
        tok = tok if tok is not None else mismatch.tokenizer
    decode: Decoder | None = None if tok is None else tokenizer_decoder(tok)
    if model is not None:
        show_mismatch(mismatch, output_format == OutputFormat.JSON, decode)
        return
    if routing is not None:
        if output_format == OutputFormat.JSON:
            typer.echo(json.dumps(token_routing))
        else:
            render_routing(make_console(), token_routing, decode)
        return
    if output_format == OutputFormat.JSON:
        typer.echo(json.dumps(batch_to_json(batch, indices)))
        return
    render_batch(
        make_console(),
        batch,
        source.groups,
        train_step=step,
        stale=baked.stale,
        sample_indices=indices,
        decode=decode,
    )

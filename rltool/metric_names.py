"""Metric names read beyond the module that produces them, each spelled once.

A metric is a ``dict[str, float]`` with slash-namespaced keys, one family per
producer (docs/metrics.md lists them all). A name that only its producer writes
stays a literal there; a name that anything else reads (the terminal view, the
report, the driver, inspect-batch, the evaluation aggregation, another producer)
lives here, and producer and readers import it. ``tests/test_metric_names.py``
checks that every name string appears in one module of ``rltool/`` only.

Names that runs wrote before a rename are mapped to the new ones by
``app/run_reader.py`` (``OLD_NAMES``), so ``rltool report`` still draws old runs.
"""

from __future__ import annotations

# ---- data/*: the trained batch, from conversion (training/convert.py, data_info)
DATA_TRAINING_SAMPLES = "data/training_samples"
DATA_SUPERVISED_TOKENS = "data/supervised_tokens"
DATA_SKIPPED_GROUPS = "data/skipped_groups"
# prompts dropped before the run for not fitting the context (produce/prompt_fit.py)
DATA_TOO_LONG_SKIPPED = "data/too_long_skipped"  # from the training files
DATA_TOO_LONG_SKIPPED_EVAL = "data/too_long_skipped_eval"  # from the eval files
DATA_RESPONSE_LEN = "data/response_len"  # supervised tokens per sample: + /mean, /min, /max
DATA_RESPONSE_LEN_MEAN = f"{DATA_RESPONSE_LEN}/mean"

# ---- rollout/*: every sample generated for the step, before any filter (produce/result.py)
ROLLOUT_REWARD_MEAN = "rollout/reward_mean"
ROLLOUT_RESPONSE_LEN_MEAN = "rollout/response_len/mean"  # response_ids, tool tokens included
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
ROLLOUT_SERVERS_DROPPED = "rollout/servers_dropped"  # hung or down (engines/openai_server.py)
# bytes of the weights the engine was sent since the previous step's generation: LoRA
# adapters or merged full weights (engines/chunked.py)
ROLLOUT_WEIGHT_SYNC_BYTES = "rollout/weight_sync_bytes"
# + a component's name: its mean over the step's samples whose reward has "components"
ROLLOUT_REWARD_COMPONENTS = "rollout/reward_components/"

# ---- failures/*: FAILED samples of the step by short reason (produce/result.py)
FAILURES = "failures/"  # + a short reason (rollout/failures.py)
FAILURES_SAMPLES = f"{FAILURES}samples"

# ---- staleness/*: the step's batch, from the producer and its replay buffer; inspect-batch
STALENESS_MEAN = "staleness/mean"  # over every response token of the batch
STALENESS_MAX = "staleness/max"
STALENESS_TOKENS = (  # response tokens by staleness 0 (or less), 1, 2 and more
    "staleness/tokens_s0",
    "staleness/tokens_s1",
    "staleness/tokens_s2plus",
)
STALE_TOKENS = "staleness/stale_tokens"  # supervised tokens marked as not trained (too stale)
EXPIRED_SAMPLES = "staleness/expired_samples"  # samples of the groups that expired

# ---- actor/*: the policy update (training/updater.py)
ACTOR_KL = "actor/kl"
ACTOR_ROLLOUT_KL = "actor/rollout_kl"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_CLIP_FRAC = "actor/clip_frac"
ACTOR_GRAD_NORM = "actor/grad_norm"

# ---- reward/*: the agent loops' reward counters (agent_loops/gsm8k.py, localhost.py, verl.py)
REWARD_ERRORS = "reward/errors"

# ---- eval/*: a held-out evaluation (agent_loops/*.evaluate, produce/task_metrics.py)
EVAL = "eval/"
EVAL_ACCURACY = "eval/accuracy"
# its 95% percentile-bootstrap interval over the eval rows (agent_loops/evaluation.py);
# over several tasks, combined in produce/task_metrics.py
EVAL_ACCURACY_CI_LOW = "eval/accuracy_ci_low"
EVAL_ACCURACY_CI_HIGH = "eval/accuracy_ci_high"
EVAL_RESPONSE_LEN_MEAN = "eval/response_len/mean"
EVAL_TRUNCATED_FRAC = "eval/truncated_frac"
EVAL_REWARD_ERRORS = "eval/reward_errors"
EVAL_FAILED = "eval/failed"  # FAILED samples
EVAL_FAILURES = "eval/failures/"  # + a short reason: FAILED samples
EVAL_N = "eval/n"  # tasks evaluated


def eval_of_task(key: str, task: str) -> str:
    """The per-task name of an ``eval/*`` figure: ``eval/<task>/accuracy``."""
    return f"{EVAL}{task}/{key.removeprefix(EVAL)}"


# ---- time/*: seconds (app/driver.py, training/controller.py)
TIME_GENERATE = "time/generate"
TIME_TRAIN = "time/train"
TIME_OVERLAP = "time/overlap"
TIME_STEP = "time/step"
TIME_EVAL = "time/eval"

# ---- alarm/*: the health alarms that fired at a step (app/alarms.py): alarm/<name> = 1 and
# alarm/<name>/value, the figure that fired it; the step line and the report read them
ALARM = "alarm/"
ALARM_VALUE = "/value"


def alarms_fired(metrics: dict[str, float]) -> list[str]:
    """The names of the alarms a metrics line records as fired."""
    return [
        k.removeprefix(ALARM)
        for k, v in metrics.items()
        if k.startswith(ALARM) and not k.endswith(ALARM_VALUE) and v
    ]

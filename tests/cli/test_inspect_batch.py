"""``rltool inspect-batch``: the golden JSON, hand-worked samples, the rich view, filters, errors.

The golden rollouts (tests/data/golden_rollouts.jsonl) hold four groups:
g-math (prompt+response, rewards 1 / 0.5 / 0), g-calc (agentic: session s0 in
two segments with tool tokens masked, plus session s1), g-fail (a FAILED
member: skipped) and g-stale (response_model_steps: at train step 5 with
max_token_staleness 1 the tokens made at step 2 are stale).

Two golden outputs: ``golden_inspect.json`` is the plain layout (``--prefix-sharing
off``, given explicitly, since a JSONL file defaults to on), ``golden_inspect_shared.json``
the shared-prefix layout of the same batch (``--prefix-sharing on``).
Regenerate them after an intended change with
``RLTOOL_UPDATE_GOLDEN=1 pytest tests/cli/test_inspect_batch.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_runner import run_cli

from rltool.cli.inspect_batch import next_train_step
from rltool.rollout.io import read_groups
from rltool.rollout.state import RolloutState
from rltool.training.convert import ConversionConfig

DATA = Path(__file__).parent.parent / "data"
ROLLOUTS = DATA / "golden_rollouts.jsonl"
GOLDEN = DATA / "golden_inspect.json"
GOLDEN_SHARED = DATA / "golden_inspect_shared.json"
M = -100

# the fixed options of the golden run
CONVERSION_OPTIONS = [
    "--estimator", "grpo",
    "--pack-max-length", "16",
    "--max-staleness", "3",
    "--max-token-staleness", "1",
    "--sync-interval", "1",
]  # fmt: skip
PLAIN, SHARED = ["--prefix-sharing", "off"], ["--prefix-sharing", "on"]
GOLDEN_OPTIONS = [*CONVERSION_OPTIONS, "--train-step", "5", *PLAIN]
SHARED_OPTIONS = [*CONVERSION_OPTIONS, "--train-step", "5", *SHARED]
SAMPLE_KEYS = [
    "rollout_id", "group_id", "pack", "start", "length", "advantage",
    "input_ids", "targets", "advantages", "rollout_logprobs",
]  # fmt: skip
PACK_KEYS = ["length", "cu_seq_lens", "position_ids"]

# GRPO, sample std (n-1), eps 1e-6, worked by hand:
# g-math rewards 1, 0.5, 0: mean 0.5, std 0.5 -> +-0.5 / 0.500001
A_MATH = 0.5 / (0.5 + 1e-6)  # 0.999998
# g-calc clusters s0 (reward 1, two segments) and s1 (0); g-stale 1 and 0: std sqrt(0.5)
A_PAIR = 0.5 / (0.5**0.5 + 1e-6)  # 0.7071058


def inspect(*args: str | Path):
    return run_cli(["inspect-batch", *args])


def json_of(*args: str | Path) -> dict:
    result = inspect(*args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def golden_json(*extra: str) -> dict:
    return json_of(ROLLOUTS, *GOLDEN_OPTIONS, *extra)


@pytest.fixture(scope="module")
def out() -> dict:
    return golden_json()


@pytest.fixture(scope="module")
def shared() -> dict:
    return json_of(ROLLOUTS, *SHARED_OPTIONS)


def by_id(out: dict) -> dict[str, dict]:
    return {s["rollout_id"]: s for s in out["samples"]}


def test_matches_golden_file(out):
    if os.environ.get("RLTOOL_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
    assert out == json.loads(GOLDEN.read_text())


def test_json_keys_in_contract_order(out):
    assert list(out) == ["layout", "attention", "samples", "packs", "skipped_groups", "data_info"]
    assert (out["layout"], out["attention"]) == ("plain", "sdpa-varlen")
    assert list(out["samples"][0]) == SAMPLE_KEYS
    assert list(out["packs"][0]) == PACK_KEYS
    assert out["skipped_groups"] == [
        {"group_id": "g-fail", "reason": out["skipped_groups"][0]["reason"]}
    ]


def test_prompt_response_sample_worked_by_hand(out):
    s = by_id(out)["math-0"]
    # input_ids [10 11 12 | 20 21 22 2], labels [-100 -100 -100 | 20 21 22 2]
    assert s["input_ids"] == [10, 11, 12, 20, 21, 22]
    assert s["targets"] == [M, M, 20, 21, 22, 2]
    assert s["rollout_logprobs"] == [0.0, 0.0, -0.1, -0.2, -0.3, -0.05]
    a = round(A_MATH, 6)
    assert s["advantage"] == a == 0.999998
    assert s["advantages"] == [0.0, 0.0, a, a, a, a]
    assert s["length"] == 6
    assert by_id(out)["math-1"]["advantage"] == 0.0
    assert by_id(out)["math-2"]["advantages"] == [0.0, 0.0, -a, -a, -a, -a, -a]


def test_agentic_segments_share_their_session_advantage(out):
    samples, a = by_id(out), round(A_PAIR, 6)
    t0 = samples["calc-s0-t0"]
    # input_ids [30 31 | 40 41 50 51 42]; 50 51 are tool output (label -100)
    assert t0["input_ids"] == [30, 31, 40, 41, 50, 51]
    assert t0["targets"] == [M, 40, 41, M, M, 42]
    assert t0["advantages"] == [0.0, a, a, 0.0, 0.0, a]
    assert t0["rollout_logprobs"] == [0.0, -0.11, -0.12, 0.0, 0.0, -0.13]
    t1 = samples["calc-s0-t1"]
    assert t1["targets"] == [M] * 7 + [43, 2]
    assert t1["advantage"] == t0["advantage"] == a
    assert samples["calc-s1"]["advantage"] == -a
    assert samples["calc-s1"]["targets"] == [M, 44, M, 45, 2]


def test_stale_tokens_are_cleared(out):
    s, a = by_id(out)["stale-0"], round(A_PAIR, 6)
    # response 70 71 72 73 2 made at steps 2 2 3 4 4: staleness at step 5 = 2 2 1 0 0,
    # trainable while staleness < (1 + 1) * 1, so 70 and 71 are cleared
    assert s["input_ids"] == [60, 61, 70, 71, 72, 73]
    assert s["targets"] == [M, M, M, 72, 73, 2]
    assert s["advantages"] == [0.0, 0.0, 0.0, a, a, a]
    assert s["rollout_logprobs"] == [0.0, 0.0, 0.0, -0.43, -0.44, -0.45]
    assert by_id(out)["stale-1"]["targets"] == [M, 74, 75, 2]


def test_every_sample_is_its_labels_shifted_once(out):
    """Contract section 5.3 over all samples: input = ids[:-1], targets = labels[1:]
    (stale ones cleared), advantage exactly where the target is supervised."""
    originals = {s.rollout_id: s for g in read_groups(ROLLOUTS) for s in g}
    packs = out["packs"]
    assert len(out["samples"]) == 8  # g-fail's two samples are skipped
    stale = {"stale-0": {1, 2}}  # shifted positions of the cleared tokens 70 71
    for s in out["samples"]:
        orig = originals[s["rollout_id"]]
        expected = [
            M if i in stale.get(s["rollout_id"], ()) else label
            for i, label in enumerate(orig.labels[1:])
        ]
        assert s["input_ids"] == orig.input_ids[:-1].tolist()
        assert s["targets"] == expected
        assert len(s["advantages"]) == len(s["rollout_logprobs"]) == s["length"]
        assert s["advantages"] == [0.0 if t == M else s["advantage"] for t in s["targets"]]
        pack = packs[s["pack"]]
        assert s["start"] in pack["cu_seq_lens"]
        assert pack["position_ids"][s["start"] : s["start"] + s["length"]] == list(
            range(s["length"])
        )
    assert all(p["length"] <= 16 for p in packs)


def test_sample_and_limit_filter_samples_only(out):
    one = golden_json("--sample", "calc-s1")
    assert [s["rollout_id"] for s in one["samples"]] == ["calc-s1"]
    assert one["samples"][0] == by_id(out)["calc-s1"]
    assert (one["packs"], one["data_info"]) == (out["packs"], out["data_info"])
    two = golden_json("--limit", "2")
    assert two["samples"] == out["samples"][:2]


def test_rich_view_shows_legend_packs_tokens_and_skipped_group():
    result = inspect(ROLLOUTS, *GOLDEN_OPTIONS)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "legend:" in text and "supervised" in text and "masked" in text and "stale" in text
    assert "pack 0: cu_seq_lens=[0, " in text and "pack 1: cu_seq_lens=" in text
    assert "math-0" in text and "calc-s0-t1" in text and "advantage +0.999998" in text
    assert "data_info" in text
    assert "skipped groups" in text and "g-fail" in text


def test_rich_view_sample_filter():
    result = inspect(ROLLOUTS, *GOLDEN_OPTIONS, "--sample", "stale-0")
    assert result.exit_code == 0, result.output
    assert "stale-0" in result.stdout and "math-0" not in result.stdout
    # targets: 61 (prompt), 70 71 (stale), 72 73 2 (supervised)
    assert "supervised 3  masked 1  stale 2" in result.stdout


def _write(path: Path, states: list[RolloutState]) -> Path:
    path.write_text("".join(s.to_json() + "\n" for s in states))
    return path


def _long_sample(n: int) -> RolloutState:
    prompt, response = list(range(100, 110)), list(range(200, 200 + n - 10))
    return RolloutState(
        rollout_id="long-0", group_id="g-long", prompt_ids=prompt, response_ids=response,
        input_ids=prompt + response, labels=[M] * 10 + response,
        logprobs=[0.0] * 10 + [-0.5] * len(response), reward={"score": 1.0}, status="COMPLETED",
    )  # fmt: skip


def test_long_sample_flows_compactly(tmp_path):
    path = _write(tmp_path / "long.jsonl", [_long_sample(1024)])
    result = inspect(path, "--pack-max-length", "2048")
    assert result.exit_code == 0, result.output
    text = result.stdout
    # every token is there (ids separated by spaces), several per line, with position marks
    assert "1213" in text and "⟨100⟩" in text and "⟨1000⟩" in text
    assert len(text.splitlines()) < 250


def test_tokenizer_decodes_tokens(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"w{i}": i for i in range(80)}
    Tokenizer(WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    result = inspect(ROLLOUTS, "--sample", "math-0", "--tokenizer", tmp_path / "tokenizer.json")
    assert result.exit_code == 0, result.output
    assert "w20" in result.stdout and "w12" in result.stdout


def test_missing_file_exits_2():
    result = inspect("no/such/rollouts.jsonl")
    assert result.exit_code == 2
    assert "does not exist" in result.output
    assert "Traceback" not in result.output


def test_bad_line_exits_1_naming_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = ROLLOUTS.read_text().splitlines()
    path.write_text(good[0] + "\n" + '{"rollout_id": "x", "group_id": 3}\n')
    result = inspect(path)
    assert result.exit_code == 1
    assert f"{path}:2" in result.output
    assert "Traceback" not in result.output


def test_a_line_that_is_not_utf8_exits_1_naming_file_line_and_byte(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(ROLLOUTS.read_bytes().splitlines()[0] + b"\n\xfe\n")
    result = inspect(path)
    assert result.exit_code == 1
    assert f"{path}:2: not valid UTF-8: byte 0xfe at byte 1 of the line" in result.output
    assert "Traceback" not in result.output


def test_sample_longer_than_pack_exits_1_naming_it():
    # calc-s0-t1 has 10 tokens, 9 after the shift
    result = inspect(ROLLOUTS, "--pack-max-length", "8")
    assert result.exit_code == 1
    assert "calc-s0-t1" in result.output
    assert not isinstance(result.exception, ValueError)


def test_unknown_sample_exits_1():
    result = inspect(ROLLOUTS, "--sample", "fail-0")
    assert result.exit_code == 1
    assert "fail-0" in result.output and "g-fail" in result.output


def test_unknown_estimator_exits_2():
    result = inspect(ROLLOUTS, "--estimator", "nope")
    assert result.exit_code == 2
    assert "nope" in result.output and "Traceback" not in result.output


def test_overrides_need_a_recipe():
    result = inspect(ROLLOUTS, "trainer.seed=1")
    assert result.exit_code == 2


def fake_generation(monkeypatch, recipe_text: str = "") -> Callable[[], list]:
    """``rltool.app.run`` replaced by a generation that returns the golden rollouts at step 5
    with the conversion settings of the recipe text; returns the calls made."""
    from rltool.config.loader import load_recipe

    calls = []

    def generate_batch_from_recipe(path: str, overrides: list[str]):
        calls.append((path, overrides))
        cfg = ConversionConfig.from_recipe(load_recipe(path, overrides))
        return read_groups(ROLLOUTS), None, cfg, 5

    fake = types.ModuleType("rltool.app.run")
    fake.generate_batch_from_recipe = generate_batch_from_recipe
    monkeypatch.setitem(sys.modules, "rltool.app.run", fake)
    return lambda: calls


def test_recipe_mode_converts_generated_groups(tmp_path, monkeypatch):
    """The recipe's groups, conversion settings and step are used; options override them."""
    calls = fake_generation(monkeypatch)
    recipe = tmp_path / "r.yml"
    recipe.write_text("trainer:\n  steps: 1\n")
    got = json_of(recipe, "trainer.seed=1", *CONVERSION_OPTIONS, *PLAIN)
    assert calls() == [(str(recipe), ["trainer.seed=1"])]
    assert got == json.loads(GOLDEN.read_text())  # step 5 from the recipe


def test_recipe_mode_takes_the_recipes_layout_and_staleness(tmp_path):
    """Without options: the recipe's trainer.prefix_sharing and algorithm staleness limits."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "trainer:\n  prefix_sharing: false\n  pack_max_length: 16\n"
        "algorithm:\n  max_staleness: 3\n  max_token_staleness: 1\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        fake_generation(mp)
        assert json_of(recipe) == json.loads(GOLDEN.read_text())
        assert json_of(recipe, *SHARED) == json.loads(GOLDEN_SHARED.read_text())
        assert json_of(recipe, "trainer.prefix_sharing=true") == json.loads(
            GOLDEN_SHARED.read_text()
        )


# ---------------------------------------------------------------- the shared-prefix layout


def test_matches_shared_golden_file(shared):
    if os.environ.get("RLTOOL_UPDATE_GOLDEN") == "1":
        GOLDEN_SHARED.write_text(json.dumps(shared, indent=1) + "\n")
    assert shared == json.loads(GOLDEN_SHARED.read_text())


def test_a_jsonl_file_shares_prefixes_by_default(shared):
    assert json_of(ROLLOUTS, *CONVERSION_OPTIONS, "--train-step", "5") == shared


def test_shared_layout_only_adds_fields(out, shared):
    """Every plain field keeps its name and order; the layout is described after them. Each
    sample's shifted fields, advantage and length are those of the plain layout."""
    assert list(shared) == list(out)
    assert all(
        list(s) == [*SAMPLE_KEYS, "prefix_length", "branch_start"] for s in shared["samples"]
    )
    assert all(list(p) == [*PACK_KEYS, "tree_ids", "branch_ids"] for p in shared["packs"])
    moved = {"pack", "start", "prefix_length", "branch_start"}
    plain = by_id(out)
    for s in shared["samples"]:
        assert {k: v for k, v in s.items() if k not in moved} == {
            k: v for k, v in plain[s["rollout_id"]].items() if k not in moved
        }
    assert shared["skipped_groups"] == out["skipped_groups"]
    layout = (
        "data/packs",
        "data/forward_positions",
        "data/padding_waste",
    )  # of the rows trained, which differ
    assert {k: v for k, v in shared["data_info"].items() if k not in layout} == {
        k: v for k, v in out["data_info"].items() if k not in layout
    }
    assert shared["data_info"]["data/packs"] == len(shared["packs"])


def test_shared_prefix_worked_by_hand(shared):
    """g-math: prompt 10 11 12, so the shared prefix is the inputs 10 11 (no targets) and each
    branch starts at input 12, position 2. Best fit put math-2 (7) first, then math-0, math-1."""
    samples, pack = by_id(shared), shared["packs"][0]
    assert [samples[r]["pack"] for r in ("math-0", "math-1", "math-2")] == [0, 0, 0]
    assert [
        (samples[r]["start"], samples[r]["prefix_length"], samples[r]["branch_start"])
        for r in ("math-2", "math-0", "math-1")
    ] == [(0, 2, 2), (0, 2, 7), (0, 2, 11)]
    # 2 prefix positions, branches of 7 - 2, 6 - 2, 5 - 2
    assert pack["length"] == 2 + 5 + 4 + 3 == 14
    assert pack["cu_seq_lens"] == [0, 7, 11, 14]  # math-2's span covers the prefix
    assert pack["branch_ids"] == [0, 0] + [1] * 5 + [2] * 4 + [3] * 3
    assert pack["tree_ids"] == [0] * 14
    assert pack["position_ids"] == [0, 1, 2, 3, 4, 5, 6, 2, 3, 4, 5, 2, 3, 4]


def test_every_shared_sample_gathers_to_its_positions(shared):
    """[start, start + prefix_length) ++ [branch_start, ...) reads positions 0 .. length - 1,
    the prefix inside branch 0 of the sample's tree, the rest inside one branch of its own."""
    for s in shared["samples"]:
        pack, q, n = shared["packs"][s["pack"]], s["prefix_length"], s["length"]
        at = [
            *range(s["start"], s["start"] + q),
            *range(s["branch_start"], s["branch_start"] + n - q),
        ]
        assert [pack["position_ids"][i] for i in at] == list(range(n))
        assert all(pack["branch_ids"][i] == 0 for i in at[:q])
        assert len({pack["branch_ids"][i] for i in at[q:]}) == 1
        assert len({pack["tree_ids"][i] for i in at}) == 1
    assert all(p["length"] <= 16 for p in shared["packs"])


def test_rich_view_shows_each_shared_prefix_once():
    result = inspect(ROLLOUTS, *SHARED_OPTIONS)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "shared-prefix trees" in text
    assert (
        text.count("shared prefix  at 0, 2 positions, shown once for math-2, math-0, math-1") == 1
    )
    assert text.count("⎇ branch at") == 8  # every sample's own part
    assert "supervised 3  masked 1  stale 2" in text  # stale-0, as in the plain view


def test_rich_view_filter_keeps_the_prefix_of_a_shown_branch():
    result = inspect(ROLLOUTS, *SHARED_OPTIONS, "--sample", "math-1")
    assert result.exit_code == 0, result.output
    assert "shared prefix  at 0, 2 positions" in result.stdout
    assert "⎇ branch at 11" in result.stdout and "math-0  group" not in result.stdout


def test_expired_group_is_skipped_by_the_explicit_bake(out):
    # --max-staleness 1: stale-0's oldest token (staleness 2) reaches (1 + 1) * 1
    got = json_of(ROLLOUTS, *GOLDEN_OPTIONS, "--max-staleness", "1")
    assert [g["group_id"] for g in got["skipped_groups"]] == ["g-fail", "g-stale"]
    assert got["skipped_groups"][1]["reason"] == "expired"
    info = got["data_info"]
    # the producer's figures: stale-0 expires, so its group (2 samples) is not trained
    assert (info["staleness/expired_samples"], info["staleness/stale_tokens"]) == (2, 2)
    assert "stale-1" not in by_id(got)


def test_empty_file_exits_1_with_no_samples(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = inspect(empty)
    assert result.exit_code == 1
    assert f"error: {empty}: no samples" in result.output


def test_a_fifo_is_refused_by_name_without_hanging(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    result = inspect(fifo)
    assert result.exit_code == 2
    assert "is a FIFO, not a regular file" in result.output
    assert "directory" not in result.output


def test_integer_ids_are_shown_as_strings(tmp_path):
    lines = [json.loads(line) for line in ROLLOUTS.read_text().splitlines() if line.strip()]
    group = [r for r in lines if r["group_id"] == "g-math"]
    for i, r in enumerate(group):
        r["rollout_id"], r["group_id"] = 100 + i, 7
    path = tmp_path / "ints.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in group))
    result = inspect(path, "--format", "json")
    assert result.exit_code == 0, result.output
    ids = [s["rollout_id"] for s in json.loads(result.stdout)["samples"]]
    assert ids == [str(100 + i) for i in range(len(group))]


@pytest.mark.parametrize(
    ("switch", "line"),
    [(PLAIN, "rows: plain layout, attention sdpa-varlen (causal SDPA per sample"),
     (SHARED, "rows: shared-prefix layout, attention sdpa-tree (SDPA per shared prefix")],
)  # fmt: skip
def test_rich_view_names_the_layout_and_attention_kernel(switch, line):
    result = inspect(ROLLOUTS, *CONVERSION_OPTIONS, *switch)
    assert result.exit_code == 0, result.output
    assert line in result.stdout


def test_a_file_without_train_step_is_inspected_at_its_newest_model_step_plus_1() -> None:
    """g-stale's tokens were made at steps 2..4: the default step is 5, never one that
    gives a token a negative staleness (before: step 0, staleness -3..-5)."""
    assert next_train_step(read_groups(ROLLOUTS)) == 5
    assert json_of(ROLLOUTS, *CONVERSION_OPTIONS, *PLAIN) == json_of(ROLLOUTS, *GOLDEN_OPTIONS)
    stale = json_of(ROLLOUTS, *CONVERSION_OPTIONS, *PLAIN)["data_info"]
    assert stale["staleness/stale_tokens"] == 2  # 70 and 71, as at --train-step 5


def test_next_train_step_of_files_without_model_steps_is_0() -> None:
    groups = read_groups(ROLLOUTS)
    no_steps = [[s for s in g if s.response_model_steps is None] for g in groups]
    assert next_train_step([g for g in no_steps if g]) == 0


def test_fields_of_other_frameworks_are_shown_with_one_warning_each(tmp_path: Path) -> None:
    lines = [json.loads(line) for line in ROLLOUTS.read_text().splitlines() if line.strip()]
    path = tmp_path / "verl.jsonl"
    path.write_text("".join(json.dumps({**r, "uid": r["group_id"]}) + "\n" for r in lines))
    result = inspect(path, *GOLDEN_OPTIONS, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json_of(ROLLOUTS, *GOLDEN_OPTIONS)
    assert result.stderr.count("warning:") == 1
    assert "field 'uid' is not part of rltool's data contract" in result.stderr

"""One name per figure: every metric name string in ``rltool/`` is spelled in one module
only (a name read beyond its producer lives in ``rltool/metric_names.py``; docs/metrics.md).
Read from the source with ``ast``: string constants (f-string pieces included) that look
like a slash-namespaced metric name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rltool import metric_names as mn

PACKAGE = Path(__file__).parents[1] / "rltool"
# "family/name...", or a family prefix "family/" that names are built from
NAME = re.compile(r"[a-z_]+/[a-z0-9_/]*")
NOT_METRICS = {"application/json", "text/javascript"}  # MIME types


def _names_by_module() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text(), module)):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and NAME.fullmatch(text) and text not in NOT_METRICS:
                found.setdefault(text, set()).add(module)
    return found


def test_each_metric_name_is_spelled_in_one_module() -> None:
    found = _names_by_module()
    assert "eval/accuracy" in found and "actor/pg_loss" in found  # the scan sees names
    spread = {name: sorted(mods) for name, mods in found.items() if len(mods) > 1}
    assert spread == {}, (
        "metric names spelled in more than one module: define each once "
        "(rltool/metric_names.py for a name read beyond its producer) and import it"
    )


def test_the_names_module_holds_what_the_report_reads() -> None:
    found = _names_by_module()
    for name in ("eval/accuracy", "staleness/stale_tokens", "rollout/response_len/mean"):
        assert found[name] == {"rltool/metric_names.py"}, name


def test_one_spelling_of_response_length() -> None:
    lengths = [mn.DATA_RESPONSE_LEN_MEAN, mn.ROLLOUT_RESPONSE_LEN_MEAN, mn.EVAL_RESPONSE_LEN_MEAN]
    assert {n.split("/", 1)[1] for n in lengths} == {"response_len/mean"}
    assert mn.eval_of_task(mn.EVAL_ACCURACY, "add") == "eval/add/accuracy"

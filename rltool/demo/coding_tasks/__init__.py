"""Six small Python coding tasks for the ``sandbox`` loop (``tasks.jsonl``).

Each record: ``question`` (the prompt), ``answer`` (a reference solution, never
shown to the agent), ``solution_file``, seed ``files``, and a hidden check
(``check`` argv, ``check_files`` bound read-only at /check) that imports the
solution from /work and tests it with plain asserts: exit 0 means solved. The
tiny demo model will not solve them; they exercise the data path.
"""

from pathlib import Path

CODING_TASKS_FILE = Path(__file__).parent / "tasks.jsonl"

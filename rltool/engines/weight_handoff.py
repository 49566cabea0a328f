"""How the trainer's weights reach an engine that holds its own copy (vLLM, servers).

``write_weights_file`` writes a state dict as one safetensors file, atomically;
``PendingWeights`` applies a written file (or a LoRA adapter's folder) at once, or,
during a ``generate``, at the next pause point or when the call ends.
Design: docs/engines.md#weight-hand-off
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

Apply = Callable[[Path, int], None]
Hook = Callable[[], None]


def write_weights_file(
    state_dict: Mapping[str, torch.Tensor], path: Path, drop_tied: bool = False
) -> Path:
    """Write ``state_dict`` to ``path`` as contiguous CPU tensors, under a temporary name
    then renamed (a reader never sees half a file). safetensors refuses tensors that share
    storage: a tensor that is another's alias (a tied LM head) is left out with
    ``drop_tied`` (the loader ties it again), else saved as a copy, as is any other tensor
    on a storage already written."""
    seen: dict[int, set[tuple]] = {}  # storage pointer -> views of it written
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        ptr = t.untyped_storage().data_ptr()
        view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        views = seen.setdefault(ptr, set())
        if view in views and drop_tied:
            continue
        cpu = t.detach().to("cpu").contiguous()
        shared = bool(views) and cpu.untyped_storage().data_ptr() == ptr
        tensors[name] = cpu.clone() if shared else cpu
        views.add(view)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def discard(path: Path) -> None:
    """Remove a written weights file, or an adapter's folder (``lora_sync.write_adapter``)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class PendingWeights:
    """The step of the weights an engine holds, and a written file waiting to be applied.

    ``apply(path, step)`` loads a file into the engine; it runs under this object's lock,
    so loads never overlap or run out of order. ``owner`` names the engine in errors.
    """

    def __init__(self, apply: Apply, owner: str, step: int = 0):
        self._apply = apply
        self.owner = owner
        self.step = step  # of the weights the engine holds
        self._lock = threading.Lock()
        self._generating = False
        self._pending: tuple[Path, int] | None = None

    @property
    def waiting(self) -> bool:
        return self._pending is not None

    def check(self, step: int) -> None:
        """ValueError if ``step`` is older than the newest weights held or waiting."""
        with self._lock:
            self._check_locked(step)

    def offer(self, path: Path, step: int) -> None:
        """Apply ``path`` now when no ``generate`` runs; else keep it for the next pause
        point, replacing (and deleting) a file still waiting."""
        with self._lock:
            try:
                self._check_locked(step)
            except ValueError:
                discard(path)
                raise
            if self._pending is not None and self._pending[0] != path:
                discard(self._pending[0])
            self._pending = (path, step)
            if not self._generating:
                self._apply_locked()

    def apply_waiting(self) -> None:
        """A pause point: apply the waiting file, if any."""
        with self._lock:
            self._apply_locked()

    @contextmanager
    def generating(self, start: Hook | None = None, end: Hook | None = None) -> Iterator[None]:
        """One ``generate`` at a time; waiting weights are applied before it and after it.
        ``start`` runs after that first apply, ``end`` after the last, both under the lock."""
        with self._lock:
            if self._generating:
                raise RuntimeError(f"{self.owner}.generate is already running; one call at a time")
            self._generating = True
            try:
                self._apply_locked()
                if start is not None:
                    start()
            except BaseException:
                self._generating = False
                raise
        try:
            yield
        finally:
            with self._lock:
                self._generating = False
                self._apply_locked()
                if end is not None:
                    end()

    def _check_locked(self, step: int) -> None:
        latest = self._pending[1] if self._pending is not None else self.step
        if step < latest:
            raise ValueError(f"load_weights({step}) goes back from step {latest}")

    def _apply_locked(self) -> None:
        """The waiting file is cleared only once applied: a failed load stays waiting."""
        if self._pending is None:
            return
        path, step = self._pending
        self._apply(path, step)
        self._pending = None
        self.step = step

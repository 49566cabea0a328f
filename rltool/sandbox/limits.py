"""Resource limits of one sandboxed command, and the ``prlimit`` prefix that applies them.

Every limit but the wall clock and the work dir's ``disk_bytes`` is an rlimit set inside
the sandbox; the real memory bound of a sandbox is ``memory_bound_bytes``: the address
space of every process it may have, plus its tmpfs.
Design: docs/sandbox.md#resource-limits
"""

from __future__ import annotations

from dataclasses import dataclass, fields

PRLIMIT = "/usr/bin/prlimit"  # util-linux; the sandbox sees the host's /usr read-only
MIN_OPEN_FILES = 16  # a Python interpreter holds about ten descriptors once started


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxLimits:
    cpu_seconds: int = 60
    """RLIMIT_CPU per process: SIGXCPU at this many CPU seconds, SIGKILL one second later."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS per process: address space, not resident memory; allocations beyond it fail."""
    max_processes: int = 64
    """RLIMIT_NPROC for the sandbox (its bwrap init and every thread count); fork fails past it."""
    max_open_files: int = 64
    """RLIMIT_NOFILE per process: descriptors (files, sockets, pipes) it may hold at once; past
    it open/socket fail with EMFILE. Keeps held sockets from draining the trainer's fds."""
    max_file_bytes: int = 64 << 20
    """RLIMIT_FSIZE: no single file can be written past this size (SIGXFSZ / EFBIG)."""
    wall_clock_s: float = 120.0
    """Host-enforced: past it the whole sandbox is killed and the result is a timeout."""
    output_bytes: int = 64 << 10
    """Bytes kept of each of stdout and stderr (head and tail); the rest is read and dropped."""
    tmp_bytes: int = 64 << 20
    """Size of the sandbox's /tmp and /dev/shm tmpfs each (host memory, so it is capped)."""
    disk_bytes: int = 1 << 30
    """Total bytes the work dir may hold, seed included: past it writes fail (ENOSPC) and the
    run ends LIMIT. Set by the spec's limits when the work dir is made (docs/sandbox.md)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"SandboxLimits.{f.name} must be a positive number, got {value!r}")
            if f.name != "wall_clock_s" and not isinstance(value, int):
                raise ValueError(f"SandboxLimits.{f.name} must be an integer, got {value!r}")
        if self.max_processes < 2:
            # the sandbox's bwrap init counts as one process
            raise ValueError(
                f"SandboxLimits.max_processes must be at least 2 (init + command), "
                f"got {self.max_processes}"
            )
        if self.max_open_files < MIN_OPEN_FILES:
            raise ValueError(
                f"SandboxLimits.max_open_files must be at least {MIN_OPEN_FILES} (an interpreter "
                f"needs about ten to start), got {self.max_open_files}"
            )

    @property
    def memory_bound_bytes(self) -> int:
        """What one sandbox can hold in memory at most: RLIMIT_AS per process times the
        process cap (threads share an address space, so fewer in practice), plus its /tmp and
        /dev/shm tmpfs. As root the work dir is a tmpfs too: add ``disk_bytes``."""
        return self.max_processes * self.memory_bytes + 2 * self.tmp_bytes


def prlimit_argv(limits: SandboxLimits) -> list[str]:
    """The argv prefix that sets the limits (soft and hard) and then execs the command.

    The hard CPU limit sits one second above the soft one so that an overrun is
    first reported by SIGXCPU, which tells it apart from other SIGKILLs. Core
    dumps are off: the kernel's core pattern here writes them into the cwd (/work).
    """
    cpu = limits.cpu_seconds
    return [
        PRLIMIT,
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={limits.memory_bytes}",
        f"--nproc={limits.max_processes}",
        f"--fsize={limits.max_file_bytes}",
        f"--nofile={limits.max_open_files}",
        "--core=0",
        "--",
    ]

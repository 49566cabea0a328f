"""Running agent loops written for verl's agent-loop interface inside rltool.

What such a loop talks to (``config``, ``server``, ``convert``), all duck-typed so that verl
is not a dependency of rltool. Design: docs/agent-loops.md#verl-compatibility
"""

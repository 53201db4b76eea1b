"""Errors the engine raises for bad input.

Every bad-input error names *where* it happened (a node, a CLI command or an API function), *which input*
was wrong and *what was expected*. The engine does not know which node called it, so it raises
:class:`InputError` with the input name and the expectation; the node adapter (or CLI) fills in ``where``.
"""

from __future__ import annotations


class FewStepError(Exception):
    """Base class of every error this package raises on purpose."""


class InputError(FewStepError, ValueError):
    """A user-facing input was wrong.

    ``str(err)`` reads ``"<where>: input '<input_name>': <problem>"`` once ``where`` is known.
    """

    def __init__(self, input_name: str, problem: str, where: str | None = None):
        self.input_name = input_name
        self.problem = problem
        self.where = where
        super().__init__(self._render())

    def _render(self) -> str:
        head = f"{self.where}: " if self.where else ""
        return f"{head}input '{self.input_name}': {self.problem}"

    def located(self, where: str) -> InputError:
        """The same error attributed to ``where`` (kept if it was already attributed)."""
        if self.where is None:
            self.where = where
            self.args = (self._render(),)
        return self

    def __str__(self) -> str:
        return self._render()


class CheckpointError(InputError):
    """A weights file could not be understood (unknown layout, missing or unexpected keys...)."""

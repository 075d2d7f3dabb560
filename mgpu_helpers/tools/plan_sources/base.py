"""What every source of a model for ``mgpu-plan`` gives (:class:`Source`) and how it says no
(:class:`PlanInputError`): the lowest module of ``plan_sources``, imported by the others."""

import contextlib
import logging
import warnings
from dataclasses import dataclass, field


class PlanInputError(Exception):
    """Bad input to ``mgpu-plan``: the message is the one line the user sees."""


@dataclass
class Source:
    name: str
    kind: str              # "built-in", "hugging face", "function"
    model_fn: object       # called with no arguments under a fake mode
    inputs: str            # "tokens" (long [B, T]) or "tensor" (float [B, *shape])
    step: str = "the course's step: cross-entropy of the model's output, the planner's Checkpointed blocks"
    optimizer: str = "adam"
    assumptions: list = field(default_factory=list)  # what the plan assumes that a trace cannot know (routing)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else "(no message)"


@contextlib.contextmanager
def quiet():
    """stderr stays the user's while tracing: libraries' warnings and logs are not the plan (a failure: one line)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.disable(previous)

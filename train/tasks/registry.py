"""The tasks by ``model.task`` name."""

from __future__ import annotations

from train.tasks.base import Task
from train.tasks.causal_lm import CausalLM
from train.tasks.classification import Classification

TASKS: dict[str, type[Task]] = {"classification": Classification, "causal-lm": CausalLM}


def task_for(name: str) -> Task:
    """The task called ``name`` (``model.task``; the config has checked it is one of :data:`TASKS`)."""
    return TASKS[name]()

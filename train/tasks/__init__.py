"""Tasks: what a batch's loss and held-out quality are (train/tasks/base.py). ``task_for(cfg.model.task)``."""

from train.tasks.base import Metrics, Task
from train.tasks.causal_lm import IGNORE_INDEX, CausalLM
from train.tasks.classification import Classification
from train.tasks.registry import TASKS, task_for

__all__ = ["IGNORE_INDEX", "TASKS", "CausalLM", "Classification", "Metrics", "Task", "task_for"]

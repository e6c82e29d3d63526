"""Downstream evaluation: multiple-choice tasks scored by the model's log-likelihoods."""

from titanlite.downstream.evaluator import DownstreamEvaluator
from titanlite.downstream.tasks import Item, Task, read_task, shipped_tasks

__all__ = ["DownstreamEvaluator", "Item", "Task", "read_task", "shipped_tasks"]

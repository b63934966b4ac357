"""Continuous batching: Scheduler(policy, executor, io) and the policies that form batches."""

from engine.scheduler.policy import BatchPolicy, PolicyConfig
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.updates import RequestUpdate

__all__ = ["BatchPolicy", "PolicyConfig", "RequestUpdate", "Scheduler"]

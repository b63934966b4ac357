"""Continuous batching: Scheduler(policy, executor, io, config) and the policies that form batches."""

from engine.scheduler.policy import BatchPolicy, PolicyConfig
from engine.scheduler.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.updates import RequestUpdate

__all__ = ["BatchPolicy", "PolicyConfig", "RequestUpdate", "Scheduler", "SchedulerConfig"]

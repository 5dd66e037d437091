"""Offline batch jobs in the OpenAI batch file format (``specbatch run-batch``)."""

from specbatch.batch.job import BatchJob, BatchSummary, Shard

__all__ = ["BatchJob", "BatchSummary", "Shard"]

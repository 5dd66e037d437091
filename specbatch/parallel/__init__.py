"""Tensor parallelism over ``torch.distributed``: the worker processes and their step protocol
(the model's slicing and collectives are in :mod:`specbatch.models.tensor_parallel`)."""

"""Turning a step into tensors: the flat ragged batch, the model runner, CUDA-graph replays."""

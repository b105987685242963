"""The engine core: requests, the continuous-batching scheduler, the model runner and the
step loop."""

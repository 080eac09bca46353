"""Scale-out: tensor parallelism over torch.distributed (parallel.py, executor.py, worker.py)
and engine replicas placed by Ray (ray_placement.py)."""

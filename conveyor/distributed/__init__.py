"""Scale-out: tensor parallelism over torch.distributed (parallel.py, executor.py, worker.py).
Engine replicas (data parallelism, Ray) are engine cores: engine/data_parallel.py and
engine/ray_placement.py."""

"""The experiment lab: benchmarks that compare conveyor with its alternatives and with itself
(batching policies, the engine-core process, speculative decoding, structured output, scale-out,
the dashboard's cost, one step against the machine's floor, quantization quality, kernels).

Not part of the installed package: run from a clone of the repository, at its root, as
`python -m benchmarks <command>` after `pip install -e '.[benchmarks]'` (see benchmarks/cli.py).
The server's own benchmarks, `conveyor bench serve | throughput`, stay in conveyor/bench/.
"""

"""Engine flags shared by every command that builds an engine (generate, serve, bench): all of
them generated from EngineArgs' fields (engine_args.py), so a setting and its flag are one.

Its own module so that the command-line front (cli.py) and the benchmark commands
(bench/, benchmarks/) both import it instead of each other.
"""

from __future__ import annotations

import argparse

from conveyor.engine_args import EngineArgs


def add_model_arg(parser) -> None:
    EngineArgs.add_cli_args(parser, names=("model",))


def add_model_args(parser) -> None:
    """The model and where it runs: shared by the engine flags and the benchmarks."""
    EngineArgs.add_cli_args(parser, names=("model", "dtype", "device"))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, in groups: model, engine, scale-out, speculative decoding,
    structured output."""
    EngineArgs.add_cli_args(parser)


def engine_args(namespace: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of a command line parsed with add_engine_args; a setting that does not
    hold is a ValueError."""
    return EngineArgs.from_cli_args(namespace)

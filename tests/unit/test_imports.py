"""The package's import graph: no module imports itself back through others (every import
counts, at the top of a file, inside a function or for the type checker), and the lightweight
entry points stay light."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import conveyor

ROOT = Path(conveyor.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The conveyor modules `name` imports, resolved to modules that exist."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from package import module` imports the module; `from module import name`
            # the module that defines the name.
            candidates = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for target in candidates:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("conveyor") and target != name:
                targets.add(target)
    return targets


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_module_import_graph_has_no_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 60 and sum(map(len, graph.values())) > 200  # it read the package
    assert "conveyor.model.config" in graph["conveyor.model.loader"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def layer(module: str) -> str:
    """A module's package below conveyor (conveyor.engine.core -> conveyor.engine); a module
    directly in conveyor is a node of its own (conveyor.config)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return module


def test_the_package_graph_has_no_cycle_either():
    """Packages import each other one way: distributed (collectives) < model < worker <
    speculative < engine < entrypoints < cli, and config, messages and engine_args need none
    of them (envs, the environment's one reader, is a leaf they may read)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {layer(t) for t in imports(name, path, known)} - {layer(name)}
        graph.setdefault(layer(name), set()).update(targets)
    assert "conveyor.entrypoints" in graph["conveyor.cli"]  # it read the packages
    assert "conveyor.model" in graph["conveyor.worker"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    for light in ("conveyor.config", "conveyor.messages", "conveyor.engine_args"):
        assert graph[light] <= {"conveyor.config", "conveyor.envs"}, (light, graph[light])
    assert graph["conveyor.envs"] == set()


def test_import_conveyor_and_the_server_pull_no_plotting():
    """matplotlib (the lab's), aiohttp and jsonschema (bench serve's) are extras: the package,
    the server and bench serve's module import none of them."""
    code = (
        "import sys, conveyor, conveyor.entrypoints.openai.api_server, conveyor.bench.serve\n"
        "heavy = [m for m in ('matplotlib', 'aiohttp', 'jsonschema') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_engine_core_given_its_model_config_imports_no_transformers(tiny_checkpoint, tmp_path):
    """An engine-core process gets its ModelConfig from the front end, which resolves it with
    transformers while the core imports torch (engine/core_proc.py): the core then builds the
    model and runs steps without importing transformers, torch._dynamo or sympy (~4 s of CPU
    of every server start)."""
    from conveyor.engine.config import resolve_model_config
    from conveyor.engine_args import EngineArgs

    args = EngineArgs.of(str(tiny_checkpoint("llama")), dtype="float32")
    (tmp_path / "settings.pkl").write_bytes(pickle.dumps((args, resolve_model_config(args))))
    code = (
        "import pickle, sys, time\n"
        "from conveyor.engine.core import EngineCore\n"
        "from conveyor.engine.core_io import CoreRequest\n"
        "from conveyor.sampling_params import SamplingParams\n"
        f"args, config = pickle.loads(open({str(tmp_path / 'settings.pkl')!r}, 'rb').read())\n"
        "core = EngineCore(args, model_config=config)\n"
        "params = SamplingParams(max_tokens=4, temperature=0)\n"
        "core.add_requests([CoreRequest('a', [5, 6, 7], params, 4, 0, time.time())])\n"
        "tokens = [t for _ in range(6) for out in core.step() for t in out.new_token_ids]\n"
        "assert len(tokens) == 4, tokens\n"
        "heavy = [m for m in ('transformers', 'torch._dynamo', 'sympy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "core.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

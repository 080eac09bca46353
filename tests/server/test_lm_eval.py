"""lm-evaluation-harness against a real `conveyor serve`: its `local-completions` backend
(loglikelihood through echo + logprobs, and generate_until) and `local-chat-completions`
(generate_until through the chat template) score two small local tasks exactly as lm_eval's own
`hf` backend scores them on the same checkpoint in float32.

The tiny random llama makes the scores meaningless but comparable: each sample's
loglikelihoods and generated text must agree, not only the aggregate. Everything is local (task
YAMLs and JSONL datasets written to a temporary folder, offline flags set): nothing touches the
network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from server_util import start_tiny

# float32 in two implementations (conveyor's kernels vs transformers' eager forward); measured
# worst difference on this checkpoint: 6e-6 for loglikelihoods of about -30.
LOGLIKELIHOOD_TOL = 1e-4
MC_TASK, GEN_TASK = "conveyor_mc", "conveyor_gen"

MC_ROWS = [
    ("The quick brown fox jumps over the", [" lazy dog", " fence", " moon", " river"], 0),
    ("Paris is the capital of", [" France", " Germany", " Spain"], 0),
    ("Berlin is the capital of", [" France", " Germany"], 1),
    ("def add(a, b): return", [" a + b", " a - b", " a * b"], 0),
    ("Continuous batching schedules one model", [" step", " day", " year"], 0),
    ("Caf\u00e9 cr\u00e8me", [" br\u00fbl\u00e9e", " glac\u00e9e"], 0),
    ("The lazy dog sleeps under the", [" tree", " table", " bridge", " sun"], 1),
    ("One, two, three,", [" four", " five", " six"], 0),
    ("\u65e5\u672c\u8a9e\u306e", ["\u6587\u7ae0", "\u4e2d\u6587"], 0),
    ("Red, green and", [" blue", " fox", " dog"], 0),
]
GEN_ROWS = [
    ("The quick brown fox", " jumps"),
    ("Paris is the capital of", " France"),
    ("def add(a, b):", " return"),
    ("Berlin is", " the capital"),
    ("Caf\u00e9", " cr\u00e8me"),
    ("One, two,", " three"),
]

# A task reading a local JSONL file (no network: the datasets cache is the test's own).
TASK_HEAD = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
"""
MC_YAML = (
    TASK_HEAD
    + """output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
)
GEN_YAML = (
    TASK_HEAD
    + """output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: target
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
)


def write_tasks(folder: Path) -> None:
    """The two task YAMLs and their JSONL datasets, in `folder`."""
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in MC_ROWS]
    gen = [{"prompt": p, "target": t} for p, t in GEN_ROWS]
    for name, task, rows, template in (
        ("mc", MC_TASK, mc, MC_YAML),
        ("gen", GEN_TASK, gen, GEN_YAML),
    ):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        yaml = template.format(task=task, data=data, cache=folder / "hf-datasets-cache")
        (folder / f"{name}.yaml").write_text(yaml)


@pytest.fixture(scope="module")
def offline():
    """HF hub and datasets in offline mode for the module: a task that reached for the hub
    would fail instead of downloading."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        import datasets.config
        import huggingface_hub.constants

        # Read at import time: set them too, in case another test imported them first.
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def task_manager(offline, tmp_path_factory):
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(folder)
    return TaskManager(include_path=str(folder), include_defaults=False)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = start_tiny(tiny_checkpoint, tmp_path_factory.mktemp("server"))
    yield proc
    assert proc.stop() == 0


def evaluate(
    task_manager, model: str, model_args: str, tasks: list[str], chat: bool = False
) -> dict[str, Any]:
    """lm_eval.simple_evaluate in this process, with every sample logged."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=task_manager,
        apply_chat_template=chat,
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.fixture(scope="module")
def completions_run(server, tiny_checkpoint, task_manager):
    # batch_size 4: requests carry several token-id prompts, answered in index order.
    args = (
        f"base_url={server.base_url}/v1/completions,model=tiny,"
        f"tokenizer={tiny_checkpoint('llama')},tokenizer_backend=huggingface,"
        "tokenized_requests=True,num_concurrent=1,max_retries=1,batch_size=4"
    )
    return evaluate(task_manager, "local-completions", args, [MC_TASK, GEN_TASK])


@pytest.fixture(scope="module")
def remote_tokenizer_run(server, task_manager):
    # No local tokenizer: lm_eval tokenizes through the server's /tokenizer_info, /tokenize and
    # /detokenize (its "remote" backend, what "auto" picks when they answer).
    args = (
        f"base_url={server.base_url}/v1/completions,model=tiny,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1,batch_size=4"
    )
    return evaluate(task_manager, "local-completions", args, [MC_TASK])


@pytest.fixture(scope="module")
def chat_run(server, task_manager):
    args = (
        f"base_url={server.base_url}/v1/chat/completions,model=tiny,num_concurrent=1,max_retries=1"
    )
    return evaluate(task_manager, "local-chat-completions", args, [GEN_TASK], chat=True)


def hf_args(tiny_checkpoint) -> str:
    return f"pretrained={tiny_checkpoint('llama')},dtype=float32,device=cpu"


@pytest.fixture(scope="module")
def hf_run(tiny_checkpoint, task_manager):
    return evaluate(task_manager, "hf", hf_args(tiny_checkpoint), [MC_TASK, GEN_TASK])


@pytest.fixture(scope="module")
def hf_chat_run(tiny_checkpoint, task_manager):
    return evaluate(task_manager, "hf", hf_args(tiny_checkpoint), [GEN_TASK], chat=True)


def choice_scores(run: dict[str, Any]) -> dict[int, list[tuple[float, bool]]]:
    """doc_id -> (loglikelihood, is_greedy) of each choice of the multiple-choice task."""
    return {
        sample["doc_id"]: [(float(ll), bool(greedy)) for ll, greedy in sample["filtered_resps"]]
        for sample in run["samples"][MC_TASK]
    }


def generations(run: dict[str, Any]) -> dict[int, str]:
    return {sample["doc_id"]: sample["filtered_resps"][0] for sample in run["samples"][GEN_TASK]}


def assert_scores_equal(run: dict[str, Any], reference: dict[str, Any]) -> None:
    """Every choice's loglikelihood and is_greedy as the reference's, and so acc and acc_norm."""
    served, expected = choice_scores(run), choice_scores(reference)
    assert sorted(served) == list(range(len(MC_ROWS)))
    assert served.keys() == expected.keys()
    for doc_id, choices in expected.items():
        got = served[doc_id]
        assert len(got) == len(choices) == len(MC_ROWS[doc_id][1])
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, choices, strict=True):
            assert abs(ll - ref_ll) < LOGLIKELIHOOD_TOL, f"doc {doc_id}: {ll} vs hf {ref_ll}"
            assert greedy == ref_greedy, f"doc {doc_id}: is_greedy differs"
    for metric in ("acc,none", "acc_norm,none"):
        assert run["results"][MC_TASK][metric] == reference["results"][MC_TASK][metric]


def test_local_completions_multiple_choice_scores_equal_hf(completions_run, hf_run):
    assert_scores_equal(completions_run, hf_run)


def test_local_completions_with_the_servers_tokenizer_equals_hf(remote_tokenizer_run, hf_run):
    assert_scores_equal(remote_tokenizer_run, hf_run)


def test_local_completions_generate_until_equals_hf(completions_run, hf_run):
    served, reference = generations(completions_run), generations(hf_run)
    assert sorted(served) == list(range(len(GEN_ROWS)))
    assert served == reference
    assert any(served.values()), "every generation empty: the comparison proves nothing"
    metric = "exact_match,none"
    assert completions_run["results"][GEN_TASK][metric] == hf_run["results"][GEN_TASK][metric]


def test_local_chat_completions_generate_until_equals_hf_chat_template(
    chat_run, hf_chat_run, hf_run
):
    served, reference = generations(chat_run), generations(hf_chat_run)
    assert sorted(served) == list(range(len(GEN_ROWS)))
    assert served == reference
    # Through the chat template the prompts differ, and so does the random model's text.
    assert served != generations(hf_run)
    metric = "exact_match,none"
    assert chat_run["results"][GEN_TASK][metric] == hf_chat_run["results"][GEN_TASK][metric]

"""Models named by their Hugging Face Hub id, as vLLM takes them: `conveyor serve Qwen/Qwen3-0.6B`.

The checkpoint's config, tokenizer and safetensors weights are downloaded once into the Hub's
cache (huggingface_hub's: $HF_HOME/hub, or the folder --download-dir names), with its progress
bars, and served from there; a later start finds them in the cache, also offline
(HF_HUB_OFFLINE=1, or no network). Only what serving reads is fetched: the top-level config
and tokenizer files and the weights the safetensors index names (never a repository's
PyTorch .bin copies, its `original/` or consolidated files). A GGUF repository is named with
the quantization to take, as vLLM spells it: `unsloth/Qwen3-0.6B-GGUF:Q4_K_M`.

A name that is a local path is always the path: the Hub is asked only for names that exist
nowhere on disk and read as a repository id.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from conveyor.config import check_prequantized

# "gpt2", "Qwen/Qwen3-0.6B", "unsloth/Qwen3-0.6B-GGUF:Q4_K_M": an optional owner, a name, and
# for a GGUF repository the quantization after a colon.
_REPO = re.compile(r"(?P<repo>(?:[\w][\w.-]{0,95}/)?[\w][\w.-]{0,95})(?::(?P<quant>[\w.-]+))?")
# The top-level files a checkpoint is read from besides its weights: config, generation config,
# tokenizer (fast, SentencePiece or tiktoken), chat template, safetensors index.
_CONFIG_FILES = ["*.json", "*.jinja", "*.model", "*.tiktoken", "merges.txt", "vocab.txt"]
_TOP_LEVEL_ONLY = ["*/*"]
_INDEX = "model.safetensors.index.json"


def looks_like_repo(model: str) -> bool:
    """Whether `model`, which is not a path on disk, reads as a Hub repository id."""
    text = str(model)
    if text.startswith((".", "/", "~")) or text.endswith(".gguf") or text.count("/") > 1:
        return False
    return _REPO.fullmatch(text) is not None


def download(
    model: str,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    load_format: str = "auto",
    weights: bool = True,
) -> Path:
    """The local path of Hub model `model` (a checkpoint folder, or for `repo:QUANT` its GGUF
    file), downloaded into the cache where it is not there yet; weights=False: its config and
    tokenizer only (a --tokenizer). ValueError, saying why, where the Hub cannot give it and
    the cache does not hold it."""
    match = _REPO.fullmatch(str(model))
    if match is None:
        raise ValueError(f"model {model!r} is not a local path nor a Hugging Face Hub repo id")
    repo, quant = match["repo"], match["quant"]
    if quant is not None or load_format == "gguf":
        if quant is None:
            raise ValueError(
                f"model {model!r}: name the GGUF file's quantization to take from the "
                f"repository, e.g. {repo}:Q4_K_M"
            )
        return _gguf_file(repo, quant, revision, download_dir, model)
    folder = _snapshot(model, repo, revision, download_dir, _CONFIG_FILES)
    if not weights:
        return folder
    check_prequantized(folder, f"model {model!r}")  # before any weight is downloaded
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model {model!r}: the Hub repository has no config.json at its top level; "
            "conveyor serves Hugging Face checkpoints (config.json + safetensors) and GGUF "
            f"files (name one as {repo}:Q4_K_M)"
        )
    weights = _weight_files(folder)
    # The weights of the very commit the config came from (its folder's name is its hash).
    folder = _snapshot(model, repo, folder.name, download_dir, weights)
    missing = [name for name in weights if "*" not in name and not (folder / name).is_file()]
    if missing or not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"model {model!r}: the Hub repository has no safetensors weights "
            f"({', '.join(missing) or '*.safetensors'}); conveyor loads safetensors, not "
            "PyTorch .bin files"
        )
    return folder


def download_files(
    repo: str,
    files: list[str],
    revision: str | None = None,
    download_dir: str | Path | None = None,
    what: str = "files",
) -> Path:
    """The local folder holding `files` (top-level names) of Hub repository `repo`, from the
    cache or downloaded: a LoRA adapter's (lora/request.py local_lora_modules). ValueError
    where the repository lacks one; `what` names them in it."""
    match = _REPO.fullmatch(repo)
    if match is None or match["quant"] is not None:
        raise ValueError(f"{what} {repo!r}: not a local folder nor a Hub repo id")
    folder = _snapshot(repo, repo, revision, download_dir, files)
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"{what} {repo!r}: the Hub repository has no {' or '.join(missing)} at its top level"
        )
    return folder


def _weight_files(folder: Path) -> list[str]:
    """The safetensors files to fetch: those the index names, else the top-level ones but
    Mistral's consolidated copy."""
    index = folder / _INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index}: not a safetensors index ({error})") from None
        if any("/" in n or ".." in n or not n.endswith(".safetensors") for n in names):
            raise ValueError(f"{index}: names a weight file outside its folder")
        return names
    return ["*.safetensors"]


def _gguf_file(
    repo: str, quant: str, revision: str | None, download_dir: str | Path | None, model: str
) -> Path:
    patterns = sorted({f"*{quant}*.gguf", f"*{quant.upper()}*.gguf", f"*{quant.lower()}*.gguf"})
    folder = _snapshot(model, repo, revision, download_dir, patterns)
    files = sorted(p for p in folder.glob("*.gguf") if quant.lower() in p.name.lower())
    if not files:
        raise ValueError(f"model {model!r}: the Hub repository has no .gguf file of {quant}")
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ValueError(
            f"model {model!r}: {quant} names several .gguf files ({names}); conveyor loads one "
            "file (a GGUF split in parts can be merged with llama.cpp's gguf-split --merge)"
        )
    return files[0]


def _snapshot(
    model: str,
    repo: str,
    revision: str | None,
    download_dir: str | Path | None,
    patterns: list[str],
) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = snapshot_download(
            repo,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=patterns,
            ignore_patterns=_TOP_LEVEL_ONLY,
        )
    except GatedRepoError:
        raise ValueError(
            f"model {model!r} is gated on the Hugging Face Hub: accept its terms on the "
            "model's page and set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"model {model!r} is not a local path, and the Hugging Face Hub has no such "
            "repository (or it is private: set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(
            f"model {model!r}: the Hub repository has no revision {revision!r}"
        ) from None
    except LocalEntryNotFoundError as error:
        reason = str(error).splitlines()[0]
        raise ValueError(
            f"model {model!r} is not a local path nor in the Hugging Face cache "
            f"({download_dir or 'HF_HOME'}), and the Hub could not be reached to download it: "
            f"{reason}"
        ) from None
    except Exception as error:  # noqa: BLE001 - a bad revision name, a full disk, a proxy
        raise ValueError(f"model {model!r}: could not get it from the Hub: {error}") from None
    return Path(path)

"""Fetch models from the Hugging Face hub: its cache, its progress bars, resumable downloads, and a clear
one-line error, quickly, when the hub cannot be reached.

Order: a complete copy in the HF cache is used without touching the network; with HF_HUB_OFFLINE=1 a
missing model is an error at once; otherwise one short request checks that the hub answers
(REDRAFTER_HUB_TIMEOUT seconds, default 5) before huggingface-hub downloads (its default client has no
timeout, so an unreachable network could otherwise hang for minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

from mlx_redrafter.environment import number
from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_json
from mlx_redrafter.models import safetensors_header

# What a model directory needs (mlx-lm's own list, minus code files).
PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


def probe_timeout() -> float:
    """Seconds to wait for the hub to answer (env REDRAFTER_HUB_TIMEOUT, default 5)."""
    return number("REDRAFTER_HUB_TIMEOUT", 5.0, 0.1)


def download_command(repo: str, filename: str | None) -> str:
    """The shell command that downloads this model into the HF cache."""
    return f"hf download {repo} {filename}" if filename else f"hf download {repo}"


def _download(repo: str, filename: str | None, local_only: bool) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download

    if filename:
        return Path(hf_hub_download(repo, filename, local_files_only=local_only))
    return Path(snapshot_download(repo, allow_patterns=PATTERNS, local_files_only=local_only))


def missing_files(snapshot: Path) -> list[str]:
    """What a model directory snapshot still lacks ([] when it is complete): config.json, a tokenizer, and its
    weights: every shard its model.safetensors.index.json lists (else at least one *.safetensors), each with a
    header that fits its size. An interrupted download leaves a snapshot with some of them: rerunning the
    download then fetches the rest."""
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    if not any((snapshot / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        missing.append("tokenizer.json")
    index = snapshot / "model.safetensors.index.json"
    try:
        shards = sorted(set(read_json(index, "weight index")["weight_map"].values())) if index.is_file() else []
    except (UserError, KeyError, TypeError, AttributeError):
        shards = []  # an unreadable index: the shards present decide
    shards = shards or sorted(f.name for f in snapshot.glob("*.safetensors")) or ["model.safetensors"]
    for name in shards:
        f = snapshot / str(name)
        try:
            safetensors_header.read_header(f)
        except UserError:
            missing.append(str(name))
    return missing


def cached(repo: str, filename: str | None = None) -> Path | None:
    """The local copy of a repo (or one file of it) if the HF cache holds it completely, else None (a snapshot
    that an interrupted download left incomplete included: see `missing_files`)."""
    try:
        path = _download(repo, filename, local_only=True)
    except Exception:  # not cached, incomplete, or a malformed repo id
        return None
    if filename is None and missing_files(path):
        return None
    return path


def partial(repo: str) -> list[str]:
    """The files an interrupted download of a model directory left missing ([] when there is no such snapshot)."""
    try:
        path = _download(repo, None, local_only=True)
    except Exception:
        return []
    return missing_files(path)


def _unreachable(endpoint: str) -> str | None:
    """Why the hub does not answer within the probe timeout (None: it answers)."""
    from huggingface_hub.utils import get_session

    timeout = probe_timeout()
    try:
        get_session().head(endpoint, timeout=timeout)
    except Exception as e:  # connection refused, DNS failure, timeout, proxy error
        return type(e).__name__
    return None


def fetch(repo: str, filename: str | None = None, label: str | None = None) -> Path:
    """Local path of a hub repo snapshot (or of one file in it), downloaded once into the HF cache."""
    from huggingface_hub import constants

    what = f"{label} ({repo}{', ' + filename if filename else ''})" if label and label != repo else (
        f"{repo}{' ' + filename if filename else ''}")
    hint = (f"download it on a connected machine with `{download_command(repo, filename)}` (cache: "
            f"{constants.HF_HUB_CACHE}) or pass a local directory / .gguf file with --model")
    path = cached(repo, filename)
    if path is not None:
        return path
    lacking = partial(repo) if filename is None else []
    shown = f"{', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}"
    if constants.HF_HUB_OFFLINE:
        if lacking:
            raise UserError(f"{what} is only partly in the Hugging Face cache (missing: {shown}; an interrupted "
                            f"download?) and HF_HUB_OFFLINE is set: rerun with the network to resume it, or {hint}")
        raise UserError(f"{what} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: {hint}")
    why = _unreachable(constants.ENDPOINT)
    if why is not None:
        raise UserError(f"cannot download {what}: {constants.ENDPOINT} is unreachable ({why}) and the model is not "
                        f"in the Hugging Face cache; {hint}")
    action = f"resuming the download of {what} (missing: {shown})" if lacking else f"downloading {what}"
    print(f"{action} into the Hugging Face cache (resumable: rerun to continue)...", file=sys.stderr)
    try:
        return _download(repo, filename, local_only=False)
    except Exception as e:
        raise UserError(_download_error(e, what, repo, hint)) from None


def _download_error(e: Exception, what: str, repo: str, hint: str) -> str:
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return f"{what} is gated: accept its license on https://huggingface.co/{repo} and run `hf auth login`"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"no model {repo} on the Hugging Face hub (if it is private, run `hf auth login`)"
    if isinstance(e, (errors.EntryNotFoundError, errors.RevisionNotFoundError)) and not isinstance(
            e, errors.LocalEntryNotFoundError):
        return f"{what}: file not found on the Hugging Face hub"
    return f"cannot download {what} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {hint}"

"""Models named by Hugging Face hub id (`ORG/NAME`, `ORG/NAME:QUANT` for one GGUF file of a repository): the files
serving needs, fetched into huggingface_hub's cache with its own client, or found there offline.

The environment is read when a model is resolved, as huggingface_hub reads it: `HF_HUB_CACHE` (else
`$HF_HOME/hub`) or `download_dir`, `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE=1` (the cache only, no network).
Only what serving reads is fetched (`SERVING_FILES`): config, generation config, tokenizer and chat template,
the image processor's files, and the top-level `model*.safetensors` with their index; never `*.bin`/`*.pth` or
other folders. huggingface_hub resumes an interrupted download and shows its progress bars. Every failure is a
ValueError that names the repository and what to do.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "*.tiktoken")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
WEIGHT_FILES = ("model.safetensors", "model-*.safetensors", "model.safetensors.index.json")
SERVING_FILES = CONFIG_FILES + TOKENIZER_FILES + PROCESSOR_FILES + WEIGHT_FILES
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+))?$")
CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[0-9a-f]{40}/?$")


@dataclass(frozen=True)
class Snapshot:
    """A repository's files in the hub cache: the folder, the repository, and the commit it holds."""

    repo_id: str
    path: Path
    commit: str
    gguf_file: str | None = None  # the GGUF file picked, for a GGUF repository


def is_hub_id(model: str | None) -> bool:
    """Whether `model` names a hub repository: `ORG/NAME[:QUANT]` that is no path on this machine."""
    return bool(model) and HUB_ID.match(model) is not None and not Path(model).exists() \
        and not model.startswith((".", "/", "~"))


def cached_repo_id(path: Path) -> str | None:
    """`ORG/NAME` for a snapshot folder of the hub cache (`.../models--ORG--NAME/snapshots/COMMIT`), else None."""
    found = CACHE_SNAPSHOT.search(str(path).replace(os.sep, "/"))
    return f"{found['org']}/{found['name']}" if found else None


def hub_cache(download_dir: str | None = None) -> str:
    """Where snapshots go: `download_dir`, else `$HF_HUB_CACHE`, else `$HF_HOME/hub` (~/.cache/huggingface/hub)."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def serving_files(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """The top-level files among `names` that match `patterns`."""
    return [name for name in names if "/" not in name and any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def pick_gguf(repo_id: str, names: list[str], quant: str | None, gguf_file: str | None) -> str:
    """The GGUF file of `repo_id` to serve: `gguf_file`, else the one whose name has `quant`, else the only one."""
    ggufs = sorted(name for name in names if name.endswith(".gguf"))
    if gguf_file is not None:
        if gguf_file not in ggufs:
            raise ValueError(f"{repo_id} has no GGUF file {gguf_file!r}; it has {ggufs}")
        return gguf_file
    matching = [name for name in ggufs if quant is not None and quant.lower() in Path(name).name.lower()]
    if len(matching) == 1:
        return matching[0]
    if quant is None and len(ggufs) == 1:
        return ggufs[0]
    which = f"several files match {quant!r}: {matching}" if matching else (
        f"none matches {quant!r}" if quant is not None else "it has several")
    raise ValueError(f"{repo_id}: pick one GGUF file with --gguf-file NAME or {repo_id}:QUANT ({which}; its "
                     f"GGUF files: {ggufs})")


def hub_error(repo_id: str, revision: str | None, err: Exception, cache: str, hub_endpoint: str,
              is_offline: bool, unreachable: Exception | None = None) -> ValueError:
    """`err` from huggingface_hub as a ValueError that says what happened and what to do; `unreachable`: the
    connection error that sent the look-up to the cache alone."""
    from huggingface_hub import errors

    where = f"in the hub cache {cache} (HF_HUB_OFFLINE=1: not looked for on the hub)" if is_offline else \
        f"on the hub at {hub_endpoint}"
    if isinstance(err, errors.GatedRepoError):
        return ValueError(f"{repo_id} is gated: accept its terms on the hub, then set HF_TOKEN to a token "
                          f"of that account")
    if isinstance(err, errors.RepositoryNotFoundError):
        return ValueError(f"model {repo_id!r} was not found {where}: check the id, or for a private repository "
                          "set HF_TOKEN")
    if isinstance(err, errors.RevisionNotFoundError):
        return ValueError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit) {where}")
    if isinstance(err, errors.IncompleteSnapshotError):
        return ValueError(f"the cached snapshot of {repo_id!r} is incomplete (an interrupted download?): run again "
                          f"without HF_HUB_OFFLINE to finish it ({err})")
    if isinstance(err, errors.LocalEntryNotFoundError):
        if is_offline:
            return ValueError(f"model {repo_id!r} (revision {revision or 'main'}) is not in the hub cache "
                              f"{cache}, and HF_HUB_OFFLINE=1 keeps it from the hub: download it first")
        reason = (unreachable or err).__class__.__name__
        return ValueError(f"cannot reach the hub at {hub_endpoint} for {repo_id!r} ({reason}), and it is not in "
                          "the hub cache: check the network, or set HF_HUB_OFFLINE=1 to serve a snapshot already "
                          "in the cache")
    return ValueError(f"cannot fetch {repo_id!r} {where}: {err.__class__.__name__}: {err}")


def http_client() -> Any:
    """The HTTP library huggingface_hub uses (httpx, or its fork httpx2), for its connection errors."""
    import huggingface_hub  # noqa: F401  (imports it)

    return sys.modules.get("httpx2") or sys.modules["httpx"]


def list_files(repo_id: str, revision: str | None, hub_endpoint: str) -> list[str]:
    """The repository's files at `revision`, from the hub."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=hub_endpoint).model_info(repo_id, revision=revision)
    return [sibling.rfilename for sibling in info.siblings or []]


def no_weights(repo_id: str, names: list[str]) -> ValueError:
    """What a repository without the safetensors weights jaxserve reads has instead."""
    weights = [n for n in names if n.endswith((".safetensors", ".bin", ".pth", ".pt", ".gguf", ".msgpack", ".h5"))]
    return ValueError(f"{repo_id} has no model*.safetensors weights at its top level (jaxserve reads safetensors, "
                      f"or one GGUF file); its weight files: {weights or 'none'}")


def snapshot(model: str, revision: str | None = None, download_dir: str | None = None,
             what: str = "model", gguf_file: str | None = None) -> Snapshot:
    """The hub repository `model` names (`ORG/NAME[:QUANT]`) at `revision` (branch, tag or commit; default
    main), in the hub cache. `what`: "model" (everything serving reads), "config" (config.json and
    generation_config.json and the image processor's, for `jaxserve compile`) or "tokenizer". Asked again in one
    process with the same environment, the hub is not asked again."""
    return cached_snapshot(model, revision, hub_cache(download_dir), what, gguf_file, endpoint(), offline())


@functools.lru_cache(maxsize=32)
def cached_snapshot(model: str, revision: str | None, cache: str, what: str, gguf_file: str | None,
                    hub_endpoint: str, is_offline: bool) -> Snapshot:
    from huggingface_hub import errors, snapshot_download

    found = HUB_ID.match(model)
    if found is None:
        raise ValueError(f"{model!r} is not a hub id ORG/NAME")
    repo_id, quant = found["repo"], found["quant"]
    patterns = {"model": SERVING_FILES, "config": CONFIG_FILES + PROCESSOR_FILES, "tokenizer": TOKENIZER_FILES}[what]
    picked, unreachable = None, None
    http = http_client()
    try:
        names = None
        if not is_offline:
            try:
                names = list_files(repo_id, revision, hub_endpoint)
            except (http.ConnectError, http.TimeoutException) as err:  # no network: the cache, as huggingface_hub
                unreachable = err
        if names is not None:
            weights = serving_files(names, WEIGHT_FILES)
            if what == "model" and (quant is not None or gguf_file is not None or (
                    not weights and any(n.endswith(".gguf") for n in names))):
                picked = pick_gguf(repo_id, names, quant, gguf_file)
                patterns = (picked,) + CONFIG_FILES
            elif what == "model" and not weights:
                raise no_weights(repo_id, names)
        elif what == "model" and (quant is not None or gguf_file is not None):
            picked = gguf_file or f"*{quant}*.gguf"
            patterns = (picked,) + CONFIG_FILES
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=list(patterns),
                                      endpoint=hub_endpoint, local_files_only=names is None))
    except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError,
            http.HTTPError, OSError) as err:  # OSError: a full disk, a cache that cannot be written
        raise hub_error(repo_id, revision, err, cache, hub_endpoint, is_offline, unreachable) from None
    if unreachable is not None:
        logger.warning("the hub at %s cannot be reached (%s): serving %s from the cache", hub_endpoint, unreachable,
                       repo_id)
    if picked is not None and names is None:
        picked = pick_gguf(repo_id, [p.name for p in path.glob("*.gguf")], quant, gguf_file)
    logger.info("model %s: revision %s (commit %s) in %s", repo_id, revision or "main", path.name, path)
    return Snapshot(repo_id, path, path.name, picked)

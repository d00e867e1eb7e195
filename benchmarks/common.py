"""Plumbing every benchmark script shares: machine description, result files, tables, seeds, engine options.

Owns: `machine_info` (CPU model and cores, GPU, library versions, load average, git commit), `write_result`
(the JSON file under benchmarks/results/ with the machine, the command line and the date added),
`format_table` / `print_block` (the short human summary at the end of a run), `seed_everything`,
`add_engine_args` / `engine_options` (the jaxserve engine flags the offline scripts share), `load_tokenizer`
and `model_label`. Timing primitives live in `benchmarks/timing.py` (another owner); this file does not time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from jaxserve.bench import machine, report

# the package's, under the names the scripts use
load_tokenizer, print_block, load_average = report.load_tokenizer, report.print_block, machine.load_average
REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_SEED = 0


def ensure_repo_on_path() -> None:
    """Lets `python benchmarks/x.py` import `benchmarks.*` and `jaxserve` from the checkout."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


# -- machine -------------------------------------------------------------------------------------------------


def git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}{'+dirty' if dirty else ''}" if commit else None


_COMMIT_AT_START: list[str | None] = []


def commit_at_start() -> str | None:
    """The checkout's commit when this process first asked (scripts ask at start-up): what the run measured."""
    if not _COMMIT_AT_START:
        _COMMIT_AT_START.append(git_commit())
    return _COMMIT_AT_START[0]


def machine_info(include_jax: bool = True) -> dict[str, Any]:
    """What the numbers were measured on (jaxserve.bench.machine's) plus the checkout's commit.
    `include_jax=False` avoids importing jax (e.g. in the HF baseline)."""
    info = {**machine.machine_info(include_jax), "git_commit": commit_at_start()}
    now = git_commit()
    if now != info["git_commit"]:
        info["git_commit_at_end"] = now
    return info


def machine_label(info: dict[str, Any]) -> str:
    """One line: 'AMD EPYC ... (2 cores), cpu backend' or the accelerator."""
    text = f"{info['cpu']} ({info['cores']} cores)"
    if info.get("backend") and info["backend"] != "cpu":
        text += f", {info['device_count']} x {info['device']}"
    return text


# -- results -------------------------------------------------------------------------------------------------


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def default_result_path(name: str) -> Path:
    return RESULTS_DIR / f"{name}.json"


def write_result(name: str, payload: dict[str, Any], path: str | os.PathLike | None = None,
                 argv: Sequence[str] | None = None, machine: dict[str, Any] | None = None) -> Path:
    """Writes `payload` plus benchmark name, date, command line and machine to `path` (default results/NAME.json)."""
    target = Path(path) if path else default_result_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "date": now_iso(),
        "command": " ".join([Path(sys.argv[0]).as_posix() if sys.argv else "?", *(argv or [])]),
        "machine": machine if machine is not None else machine_info(include_jax="jax" in sys.modules),
        **payload,
    }
    target.write_text(json.dumps(record, indent=2, default=_json_default) + "\n", encoding="utf-8")
    return target


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def read_result(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


# -- tables --------------------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 2) -> str:
    """Numbers with `digits` decimals, None/nan as 'n/a', everything else as str."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(headers)]

    def line(items: Sequence[str], numeric: Sequence[bool]) -> str:
        return "  ".join(item.rjust(w) if num else item.ljust(w) for item, w, num in zip(items, widths, numeric))

    numeric_cols = [bool(rows) and all(isinstance(row[i], (int, float)) or row[i] is None for row in rows)
                    for i in range(len(headers))]
    out = [line([str(h) for h in headers], numeric_cols), "  ".join("-" * w for w in widths)]
    out += [line(r, numeric_cols) for r in cells]
    return "\n".join(out)


# -- runs ----------------------------------------------------------------------------------------------------


class OfflineThroughput:
    """Throughput properties of an offline run dataclass with elapsed_s, num_requests, prompt_tokens and
    output_tokens fields (jaxserve's and the baselines'), and its JSON summary without the token ids."""

    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def summary(self) -> dict[str, Any]:
        import dataclasses

        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "output_token_ids"}
        data.update(request_throughput=self.request_throughput, output_throughput=self.output_throughput,
                    total_throughput=self.total_throughput)
        return data


def seed_everything(seed: int) -> None:
    """Python, numpy and (if loaded) torch RNGs; also notes the checkout's commit at the start of the run."""
    import numpy as np

    commit_at_start()
    random.seed(seed)
    np.random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed for workloads and engines (default 0)")
    parser.add_argument("--result-file", default=None, help="JSON output path (default benchmarks/results/NAME.json)")
    parser.add_argument("--no-plot", action="store_true", help="skip writing PNG plots")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """jaxserve bench's dataset flags, at the offline scripts' small defaults (64 requests, 128 in, 64 out)."""
    from jaxserve.bench import dataset_args

    dataset_args.add_dataset_args(parser, num_prompts=64)
    parser.set_defaults(random_input_len=128, random_output_len=64, custom_output_len=64,
                        prefix_repetition_output_len=64)


def add_engine_args(parser: argparse.ArgumentParser, max_num_seqs: int = 64, max_model_len: int = 512) -> None:
    """The jaxserve engine options an offline benchmark sets (vLLM's flag names)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF checkpoint dir, .gguf file or converted store (default: embedded SmolLM2-135M-Instruct)")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="devices the model is split over (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    group.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="decode slots")
    group.add_argument("--max-model-len", type=int, default=max_model_len)
    group.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (chunked prefill)")
    group.add_argument("--page-size", type=int, default=16)
    group.add_argument("--num-kv-pages", type=int, default=None)
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--attention-backend", default=None,
                       help="xla | pallas | pallas-interpret | pallas-tpu | pallas-tpu-interpret (engine default)")
    group.add_argument("--quantization", default=None, help="weights: int8 (W8A16, per output channel); default float")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(**engine_options(args))` keyword arguments from `add_engine_args` flags."""
    options = dict(model=args.model, tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                   num_kv_pages=args.num_kv_pages, dtype=args.dtype,
                   enable_prefix_caching=args.enable_prefix_caching, seed=args.seed)
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if getattr(args, "quantization", None):
        options["quantization"] = args.quantization
    return options


def model_label(model: str | None) -> str:
    from jaxserve.loading import DEFAULT_MODEL

    return DEFAULT_MODEL if model in (None, DEFAULT_MODEL) else str(model)


def start(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> tuple[list[str], argparse.Namespace]:
    """A benchmark's start: `(argv, parsed args)` from `argv` (default: the command line), logs quieted and
    every random source seeded with `--seed`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if hasattr(args, "dataset_name"):
        from jaxserve.bench import dataset_args

        problem = dataset_args.check_dataset_args(args)
        if problem:
            parser.error(problem)
    quiet_logs()
    seed_everything(args.seed)
    return argv, args


def quiet_logs() -> None:
    """Engine INFO logs (load and warm-up times) stay; library chatter goes."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge", "httpx", "httpcore", "orbax", "jax._src.compilation_cache", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

"""Greedy outputs of the shipped prompts under each engine mode, as token ids and a digest: run it at two commits
and compare the digests to show a refactor changed no output.

Modes: `plain` (`LLM()`), `tp3` (tensor parallel on 3 simulated CPU devices), `ngram` (speculative decoding by
n-gram lookup, batched verify on) and `json` (structured output: a JSON schema). Each mode runs in its own process,
since the device count is fixed when jax starts.

    python benchmarks/greedy_identity.py --num-prompts 8 --max-tokens 32 --out /tmp/a.json
    python benchmarks/greedy_identity.py --compare /tmp/a.json /tmp/b.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "tp3", "ngram", "json")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"]}


def _prompts(count: int) -> list[str]:
    lines = (ROOT / "benchmarks" / "data" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:count]]


def run_mode(mode: str, num_prompts: int, max_tokens: int) -> list[list[int]]:
    """The greedy token ids of every prompt under `mode` (in this process)."""
    sys.path.insert(0, str(ROOT))
    from jaxserve import LLM, SamplingParams
    from jaxserve.sampling_params import GuidedDecodingParams

    options: dict = {"max_model_len": 512}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=mode != "json")
    if mode == "tp3":
        options["tensor_parallel_size"] = 3
    elif mode == "ngram":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                         "disable_by_batch_size": 10_000}
    elif mode == "json":
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                guided_decoding=GuidedDecodingParams(json=SCHEMA))
    llm = LLM(**options)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in _prompts(num_prompts)]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def digest(token_ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", help="write {mode: token ids} as JSON here")
    parser.add_argument("--compare", nargs=2, metavar="JSON", help="compare two earlier runs' files")
    parser.add_argument("--one-mode", help=argparse.SUPPRESS)  # the child process of one mode
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(Path(path).read_text()) for path in args.compare)
        same = True
        for mode in sorted(set(a) | set(b)):
            match = a.get(mode) == b.get(mode)
            same &= match
            print(f"{mode:6s} {digest(a.get(mode, []))} {digest(b.get(mode, []))} {'same' if match else 'DIFFERENT'}")
        sys.exit(0 if same else 1)
    if args.one_mode:
        print(json.dumps(run_mode(args.one_mode, args.num_prompts, args.max_tokens)))
        return
    results = {}
    for mode in args.modes.split(","):
        env = dict(os.environ)
        if mode == "tp3":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3").strip()
        done = subprocess.run([sys.executable, __file__, "--one-mode", mode, "--num-prompts", str(args.num_prompts),
                               "--max-tokens", str(args.max_tokens)], env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"mode {mode} failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{mode:6s} {digest(results[mode])} ({sum(map(len, results[mode]))} tokens)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()

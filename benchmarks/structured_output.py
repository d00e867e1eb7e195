"""Structured output: what constrained decoding costs, and whether its answers parse.

One engine (default model unless `--model`) answers the same `--num-prompts` chat prompts (the shipped
jaxserve/bench/data/prompts.jsonl, each asking for its answer as JSON) offline, in one batch, three times: free
text, `json_object`, and a JSON schema (`{"answer": string, "confidence": 0-100}`). Reported per mode: output
tokens per second, host milliseconds per step in each phase (the token masks are computed in "postprocess",
while the device runs the step's forward), and the fraction of finished answers that are valid JSON (that fit
the schema, for the schema mode).

    python benchmarks/structured_output.py --num-prompts 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common
from jaxserve.bench import datasets

NAME = "structured_output"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
          "properties": {"answer": {"type": "string", "maxLength": 300},
                         "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}


def fits(mode: str, text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if mode != "json_schema":
        return isinstance(value, dict)
    return (isinstance(value, dict) and set(value) == {"answer", "confidence"} and isinstance(value["answer"], str)
            and isinstance(value["confidence"], int) and 0 <= value["confidence"] <= 100)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    common.add_engine_args(parser, max_num_seqs=16, max_model_len=1024)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    argv, args = common.start(parser, argv)
    from jaxserve import LLM, GuidedDecodingParams, SamplingParams

    llm = LLM(**common.engine_options(args))
    entries = datasets.load_prompt_file()[:args.num_prompts]
    prompts = [{"prompt_token_ids": llm.apply_chat_template(
        [{"role": "user", "content": entry["prompt"] + " Answer as a JSON object."}])} for entry in entries]
    modes = {"text": None, "json_object": GuidedDecodingParams(json_object=True),
             "json_schema": GuidedDecodingParams(json=SCHEMA)}
    engine = llm.llm_engine
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # first runs
    results, rows = {}, []
    for mode, guided in modes.items():
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, guided_decoding=guided)
        if guided is not None:
            engine.validate_guided_decoding(params)  # the grammar's compile (cached) is not the step's cost
        before = engine.phases.snapshot()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        after = engine.phases.snapshot()
        steps = max(after["steps"] - before["steps"], 1)
        phases_ms = {phase: 1000 * (after[phase] - before[phase]) / steps for phase in engine.phases.PHASES}
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        finished = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
        valid = sum(fits(mode, text) for text in finished)
        results[mode] = {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                         "steps": steps, "phases_ms": phases_ms, "finished": len(finished), "valid": valid,
                         "texts": [o.outputs[0].text for o in outputs]}
        rows.append([mode, tokens, common.fmt(tokens / seconds, 1),
                     common.fmt(tokens / seconds / results["text"]["tokens_per_s"]),
                     " / ".join(common.fmt(phases_ms[p], 3) for p in engine.phases.PHASES),
                     f"{valid}/{len(finished)}"])
    print(common.format_table(["mode", "tokens", "tok/s", "vs text", "ms per step: " + " / ".join(
        engine.phases.PHASES), "valid JSON / finished"], rows))
    payload = {"model": common.model_label(args.model), "modes": results, "summary": rows, "schema": SCHEMA}
    path = common.write_result(NAME, payload, args.result_file, argv)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()

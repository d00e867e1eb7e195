"""The `jaxserve` command: `jaxserve demo` (one chat answer with the default model), `jaxserve serve` (the
OpenAI-compatible server), `jaxserve bench` (serve | throughput | latency) and `jaxserve compile` (every start-up
step compiled for a GPU or TPU that is not attached). Several servers go behind vllm-router (docs/router.md)."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def demo(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="jaxserve demo", description="Answer one chat message with a model.")
    parser.add_argument("--model", default=None, help="a hub id ORG/NAME, HF checkpoint dir, .gguf file or converted "
                                                      "store (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from jaxserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=256)
    print(f"engine ready in {time.perf_counter() - started:.1f}s (load + compile)", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    started = time.perf_counter()
    output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - started
    completion = output.outputs[0]
    print(f"\nUser: {args.prompt}\nAssistant: {completion.text.strip()}\n")
    metrics = output.metrics
    generated = len(completion.token_ids)
    ttft = metrics.first_token_time - metrics.arrival_time
    decode_seconds = metrics.last_token_time - metrics.first_token_time
    decode_rate = f"{(generated - 1) / decode_seconds:.1f} tokens/s" if generated > 1 and decode_seconds > 0 else "n/a"
    print(f"{generated} tokens in {seconds:.2f}s: time to first token {1000 * ttft:.0f} ms "
          f"(prompt {len(output.prompt_token_ids)} tokens), then {decode_rate}; "
          f"finish_reason={completion.finish_reason}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from jaxserve.platforms import pick_platform

    pick_platform()  # before jax starts
    from jaxserve.bench import bench_main

    from jaxserve.aot.cli import compile_main

    commands = {"demo": demo, "bench": bench_main, "compile": compile_main}
    try:
        from jaxserve.server import serve_main

        commands["serve"] = serve_main
    except ImportError:
        pass
    if not argv or argv[0] not in commands:
        print(f"usage: jaxserve {{{','.join(commands)}}} [options]   (jaxserve COMMAND --help for options)")
        sys.exit(2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()

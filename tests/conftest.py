"""Shared fixtures: tiny random-weight HF models of each supported family, saved locally, and helpers."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# four host devices, so tensor-parallel tests run in this process; one-device engines use the first only
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# XLA's LLVM at -O0 without its expensive passes, and XLA:CPU's older fusion emitters, which compile faster than the
# MLIR ones: compiling the tiny models' steps is most of the suite's time, and their run time hardly counts
# (docs/testing.md)
for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
             "--xla_cpu_use_fusion_emitters=false"):
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# jax's persistent cache keeps every compile in a test run, not only those over the engine's 0.5 s
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# jax's persistent compilation cache: a fresh folder per test run (inherited by the servers and hosts tests start),
# so no entry of an earlier or killed run is read
if "JAXSERVE_CACHE_ROOT" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAXSERVE_CACHE_ROOT"] = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXSERVE_CACHE_ROOT"], ignore_errors=True)

import numpy as np
import pytest

TINY_DIMS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma2", "gemma3_text",
                 "phi3", "gpt_oss")


def tiny_hf_config(family: str, **overrides):
    """A tiny config of `family` (TINY_DIMS, with `overrides` of its sizes)."""
    import transformers

    dims = {**TINY_DIMS, **overrides}
    if family == "llama":
        return transformers.LlamaConfig(**dims, rope_theta=10000.0, tie_word_embeddings=False,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if family == "mistral":
        return transformers.MistralConfig(**dims, sliding_window=16, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**dims, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**dims, head_dim=32, tie_word_embeddings=False)
    # mixtures of experts: 4-8 experts of a quarter of the dense width; Qwen2-MoE's second layer dense
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**dims, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                           mlp_only_layers=[1], tie_word_embeddings=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**dims, head_dim=32, moe_intermediate_size=32, num_experts=8,
                                           num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    if family == "mixtral":
        return transformers.MixtralConfig(**{**dims, "intermediate_size": 32}, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=16, tie_word_embeddings=False)
    # Gemma: 4 layers, sliding and global alternating (Gemma 3: two sliding per global, a local rope base, linear
    # scaling on the global layers); windows shorter than the prompts; soft-caps low enough to bind
    if family == "gemma2":
        return transformers.Gemma2Config(**{**dims, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=24,
                                         sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "gemma3_text":
        return transformers.Gemma3TextConfig(
            **{**dims, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
            sliding_window_pattern=3, rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})
    if family == "phi3":  # fused qkv_proj and gate_up_proj; a sliding window on every layer
        return transformers.Phi3Config(**dims, sliding_window=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                       tie_word_embeddings=False)
    if family == "gpt_oss":  # sinks, biases, sliding and full layers, YaRN; a clamp low enough to bind
        return transformers.GptOssConfig(
            **{**dims, "intermediate_size": 32}, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=16, layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.5,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
            tie_word_embeddings=False)
    raise ValueError(family)


def save_tiny_model(family: str, path: str, seed: int = 0, config=None, **overrides) -> str:
    """A random-weight HF model of `family` (float32, `overrides` of TINY_DIMS, or the whole `config`) with a small
    byte-level tokenizer, saved to `path`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = config if config is not None else tiny_hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF inits small; larger weights make logits differ visibly between tokens
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
            elif (family == "gpt_oss" or getattr(config, "attention_bias", False)) and name.endswith(("bias", "sinks")):  # HF: zero
                param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.08)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path, config.vocab_size)
    return path


def save_randomized_model(family: str, path: str, config, randomize) -> str:
    """`save_tiny_model` of `config`, then `randomize(model)` on what transformers starts at fixed values (norms,
    scales), saved again: so that each enters the outputs a test compares."""
    import torch
    import transformers

    save_tiny_model(family, path, config=config)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_tiny_tokenizer(path: str, vocab_size: int, extra_specials: tuple[str, ...] = (),
                        extra_merges: tuple[tuple[str, str], ...] = ()) -> None:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens (256 bytes + merges, `extra_merges` among them,
    + specials; `extra_specials` last, in order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    merges = []
    corpus_pairs = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("e", "r"), ("o", "n")]
    for left, right in corpus_pairs + list(extra_merges):
        if left in vocab and right in vocab and len(vocab) < vocab_size - len(specials):
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    while len(vocab) < vocab_size - len(specials):
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>", "additional_special_tokens": specials[1:]})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module", autouse=True)
def release_executables():
    """After each test file, once its engines are gone, jax's caches let go of their compiled executables. They keep
    them otherwise, and each holds memory maps of its code: a process that built a few hundred engines reached the
    kernel's limit (vm.max_map_count, 65,530) and XLA:CPU segfaulted mapping the next one (tests/run_suite.py)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """The real server on the default model, shared by the end-to-end server tests (tests/default_server.py)."""
    from tests.default_server import running_server

    with running_server(tmp_path_factory.mktemp("server")) as handle:
        yield handle


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: save_tiny_model(family, str(root / family)) for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


def random_prompts(count: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(count)]


def decode_hlo(llm, rows: int) -> str:
    """The compiled text of `llm`'s decode step for a batch bucket of `rows`."""
    step = llm.llm_engine.runner.steps["decode"]
    inputs = next(inputs for inputs in step.examples() if len(inputs.slots) == rows)
    return step.fn.lower(*step.state(), inputs).compile().as_text()


def shard_shapes(array) -> set[tuple[int, ...]]:
    """The shapes of an array's shards on this process's devices."""
    return {shard.data.shape for shard in array.addressable_shards}


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy loop (float32) over each prompt: the reference the families' engine tests compare to."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist() for prompt in prompts]


def serve_app(engine, check, model: str) -> None:
    """Runs the HTTP app (in-process, no sockets) over `engine` serving `model`, through its lifespan, around
    `await check(http_client)` once it is ready."""
    import asyncio

    import httpx

    from jaxserve.server.api_server import ServerSettings, create_app

    app = create_app(engine, ServerSettings(served_model_names=[model], log_stats_interval=0))

    async def main() -> None:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=120) as http:
                while (await http.get("/health")).status_code != 200:
                    await asyncio.sleep(0.05)
                await check(http)

    asyncio.run(main())


def engine_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy tokens for each prompt (token ids in, EOS ignored)."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]

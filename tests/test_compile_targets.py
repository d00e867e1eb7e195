"""`jaxserve compile`: the engine's own steps compiled for TPU and NVIDIA targets that are not attached, and the
memory plan that comes with them (jaxserve/aot/).

Each model here is a directory holding only a config.json (no weights: the command's promise), with small shapes
but real head sizes (64, 128, 256) so the kernels meet the tiling the accelerators impose. Every step of every
family compiles for a TPU (v6e) and an H200 with the backend that platform gets by default (Mosaic TPU, Pallas on
GPU); LoRA, speculation, quantized weights and pages, tensor and expert parallelism compile on multi-device
targets; a model too large for its target is refused with one line; a step that cannot compile is reported with
the compiler's message. Compile only: nothing runs, so no numerics are checked here (the interpreters do that in
tests/test_tpu_kernels.py and tests/test_kernels.py).
"""

from __future__ import annotations

import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.aot.cli import compile_main
from jaxserve.aot.compile import compile_engine, compile_steps, plan_engine
from jaxserve.aot.report import group_json
from jaxserve.aot.targets import CompilerMissing, TARGETS, target_devices
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_budget import activation_bytes
from jaxserve.engine.step_registry import Step, StepRegistry, assign, compile_threads
from tests.conftest import TINY_FAMILIES, tiny_hf_config


def compilers_present() -> bool:
    try:
        target_devices("v6e-1"), target_devices("h200")
    except CompilerMissing:
        return False
    return True


pytestmark = pytest.mark.skipif(not compilers_present(), reason="the target compilers (the [aot] extra: libtpu, "
                                                                  "jax-cuda13-plugin) are not installed")
SMALL = dict(max_num_seqs=4, decode_batch_buckets=(4,), max_model_len=128, max_num_batched_tokens=16)
HEAD_DIMS = {"gemma2": 256, "gemma3_text": 128, "gpt_oss": 64, "qwen3": 128, "qwen3_moe": 128}  # the others: 64


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory) -> dict[str, str]:
    """Directories holding only the config.json of a small model of each family (4 query, 2 KV heads)."""
    root = tmp_path_factory.mktemp("configs")
    dirs = {}
    for family in TINY_FAMILIES:
        config = tiny_hf_config(family, hidden_size=256, intermediate_size=256)
        config.head_dim = HEAD_DIMS.get(family, 64)
        config.save_pretrained(root / family)
        dirs[family] = str(root / family)
    return dirs


def assert_compiles_and_fits(result) -> None:
    assert not result.failed, result.verdict()
    assert result.fits, result.verdict()
    limit = activation_bytes(result.plan.model_config, result.plan.engine_config)
    for step in result.steps:  # the engine's reserve for a step's activations holds what the compiler planned
        assert step.temp_bytes + max(0, step.output_bytes - step.alias_bytes) <= limit, (step, limit)


@pytest.mark.parametrize("target", ["v6e-1", "h200"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_each_family_forward_compiles_and_fits(config_dirs, family, target):
    result = compile_engine(EngineConfig(model=config_dirs[family], **SMALL), target, {"prefill", "decode"})
    assert result.plan.engine_config.attention_backend == {"v6e-1": "pallas-tpu", "h200": "pallas"}[target]
    assert result.plan.engine_config.dtype == "bfloat16"
    assert {step.name for step in result.steps} == {"prefill", "decode"}
    assert_compiles_and_fits(result)
    if target == "v6e-1":  # the TPU compiler's roofline estimate
        assert all(step.estimated_seconds for step in result.steps)
    model = result.plan.model_config  # the plan's KV cache groups cover every layer once
    groups = [group_json(group) for group in result.plan.kv_plan.groups]
    assert sum(group["layers"] for group in groups) == model.num_layers and all(g["pages"] > 1 for g in groups)
    assert len(groups) == 1 or any(window is not None for window in model.layer_sliding_windows), groups
    assert len(groups) > 1 or family not in ("mistral", "gemma3_text", "gpt_oss"), groups  # a window group each


@pytest.mark.parametrize("target, page_size", [("v5e-1", 128), ("h200", 16)])
def test_every_step_with_lora_speculation_and_quantization(config_dirs, target, page_size):
    config = EngineConfig(model=config_dirs["llama"], enable_lora=True, max_loras=2, max_lora_rank=8,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                          quantization="int8", kv_cache_dtype="int8", page_size=page_size, **SMALL)
    result = compile_engine(config, target)
    names = {step.name for step in result.steps}
    assert {"prefill", "decode", "verify", "verify_sample", "sample", "score", "lora", "reset", "ban"} <= names
    assert_compiles_and_fits(result)


@pytest.mark.parametrize("target", ["v6e-1", "h200"])
def test_the_kv_tiers_copies_compile(config_dirs, target):
    """The pages' copies to and from host memory (pinned host memory on an accelerator): a TPU's compiler refused
    the restore while its pages were still in host memory inside the step ("Fusion must have backend config")."""
    config = EngineConfig(model=config_dirs["llama"], kv_offloading_size=0.5, **SMALL)
    result = compile_engine(config, target, {"kv_store", "kv_restore"})
    assert {step.name for step in result.steps} == {"kv_store", "kv_restore"}
    assert_compiles_and_fits(result)


@pytest.mark.parametrize("target, options", [("v6e-4", dict(tensor_parallel_size=2, dtype="bfloat16")),
                                             ("h200", dict(kv_cache_dtype="fp8"))])
def test_the_pd_transfers_compile_and_report_their_pages(config_dirs, target, options):
    """Prefill/decode disaggregation's gather and scatter in device memory (bfloat16 pages split over two TPU cores;
    an fp8 pool with its scales on a GPU), the page layout the report gives, and the device memory the KV plan
    leaves for pages in transit (`kv_buffer_size`: without it Llama-3-8B's longest send did not fit an H200)."""
    config = EngineConfig(model=config_dirs["llama"], kv_transfer_config={"kv_role": "kv_both"}, **{**SMALL, **options})
    result = compile_engine(config, target, {"kv_send", "kv_receive"})
    plain, _ = plan_engine(EngineConfig(model=config_dirs["llama"], **{**SMALL, **options}), target)
    assert abs(plain.kv_cache_bytes - result.plan.kv_cache_bytes - 1e9) <= result.plan.kv_transfer["page_bytes"]
    assert {step.name for step in result.steps} == {"kv_send", "kv_receive"}
    assert_compiles_and_fits(result)
    layout = result.plan.kv_transfer
    assert layout["split"] == "P(None, None, 'model')" and layout["buckets"][0] == 4  # split by head
    assert len(layout["pages"]) == (2 if "kv_cache_dtype" in options else 1)  # values, and an fp8 pool's scales


def test_a_draft_model_compiles_from_its_config_alone(config_dirs):
    config = EngineConfig(model=config_dirs["llama"], kv_cache_dtype="fp8",
                          speculative_config={"model": config_dirs["llama"], "num_speculative_tokens": 2}, **SMALL)
    result = compile_engine(config, "h200", {"draft_prefill", "propose", "verify"})
    assert {step.name for step in result.steps} == {"draft_prefill", "propose", "verify"}
    assert_compiles_and_fits(result)


@pytest.mark.parametrize("target, family, options", [
    ("v6e-4", "qwen3_moe", dict(tensor_parallel_size=4, enable_expert_parallel=True)),
    ("v6e-4", "llama", dict(tensor_parallel_size=4)),  # 2 KV heads: each replicated on 2 devices
    ("h100x8", "mixtral", dict(tensor_parallel_size=4, enable_expert_parallel=True)),
    ("h100x8", "gemma2", dict(tensor_parallel_size=2)),
])
def test_tensor_and_expert_parallel(config_dirs, target, family, options):
    result = compile_engine(EngineConfig(model=config_dirs[family], **options, **SMALL), target,
                            {"prefill", "decode"})
    assert result.plan.num_devices == options["tensor_parallel_size"]
    assert_compiles_and_fits(result)


@pytest.mark.parametrize("options, least", [(dict(dtype="bfloat16", page_size=8), 16),
                                            (dict(kv_cache_dtype="fp8", page_size=64), 128)])
def test_a_page_the_tpu_would_store_transposed_is_refused(config_dirs, options, least):
    with pytest.raises(ValueError, match=f"page_size .--block-size. {options['page_size']} is too small for the "
                                         f"pallas-tpu attention backend .* use {least} or more"):
        compile_engine(EngineConfig(model=config_dirs["llama"], **{**SMALL, **options}), "v6e-1", {"decode"})


def test_too_large_a_model_is_refused_in_one_line(tmp_path, capsys):
    from benchmarks.random_model import write_config

    model = write_config(tmp_path / "llama-8b", "llama-3.1-8b")  # 16 GB of bfloat16 weights on a 16 GiB chip
    with pytest.raises(SystemExit) as exit_:
        compile_main(["--target", "v5e-1", "--model", model, "--output-json", str(tmp_path / "r.json")])
    assert exit_.value.code == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("does not fit on v5e-1: the weights need 14.96 GiB per device"), verdict
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["fits"] is False and written["steps"] == [] and written["weights_bytes_per_device"] > 15e9


def test_the_command_writes_its_plan(config_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        compile_main(["--target", "v6e-1", "--model", config_dirs["qwen3"], "--max-num-seqs", "4",
                      "--max-model-len", "128", "--max-num-batched-tokens", "16", "--steps", "decode,sample",
                      "--output-json", str(tmp_path / "r.json")])
    assert exit_.value.code == 0, capsys.readouterr().out
    written = json.loads((tmp_path / "r.json").read_text())
    assert {"target", "num_devices", "attention_backend", "steps", "hbm_bytes_per_device", "weights_bytes_per_device",
            "kv_cache_bytes_per_device", "kv_cache_tokens", "peak_bytes_per_device", "fits"} <= set(written)
    assert written["target"] == "v6e-1" and written["attention_backend"] == "pallas-tpu" and written["fits"]
    assert written["kv_cache_tokens"] > 0 and written["kv_cache_bytes_per_device"] > 0.8 * 32 * 2**30
    step = written["steps"][0]
    assert {"name", "shape", "compiled", "seconds", "peak_bytes", "estimated_seconds"} <= set(step)


def test_a_step_that_cannot_compile_is_reported_with_the_compilers_message():
    devices = target_devices("v6e-1")
    mesh = Mesh(np.array(devices), ("model",))
    replicated = NamedSharding(mesh, P())

    def copy_block(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def too_large(inputs):  # one 256 MiB block: far over a TPU core's VMEM
        return pl.pallas_call(copy_block, out_shape=jax.ShapeDtypeStruct(inputs.shape, inputs.dtype))(inputs), ()

    steps = StepRegistry()
    steps.add([Step("huge", jax.jit(too_large), lambda: (), assign(None),
                    lambda: [jax.ShapeDtypeStruct((8192, 8192), jnp.float32, sharding=replicated)])])
    [step] = compile_steps(steps, "v6e-1", 0)
    assert not step.compiled and step.name == "huge"
    assert "vmem" in step.error.lower(), step.error


def test_the_estimate_leaves_out_the_sentinels_of_uncosted_custom_calls():
    """Three Llama MLP blocks (hidden 1024, batch 4) on a v6e: memory-space assignment prefetches the third block's
    gate_up weight into VMEM in two slices joined by a ConcatBitcast, which the TPU cost analysis marks "unknown"
    with -1 s; the estimate is the rest, about that of the same program prefetched in one piece."""
    devices = target_devices("v6e-1")
    replicated = NamedSharding(Mesh(np.array(devices[:1]), ("model",)), P())

    def blocks(inputs):
        x, params = inputs
        for norm, gate_up, down in params:
            h = x.astype(jnp.float32)
            h = (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)).astype(x.dtype) * norm
            gate, up = jnp.split(h @ gate_up, 2, -1)
            x = x + (jax.nn.silu(gate) * up) @ down
        return x, ()

    shape = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.bfloat16, sharding=replicated)
    example = (shape(4, 1024), [(shape(1024), shape(1024, 4096), shape(2048, 1024))] * 3)
    lowered = jax.jit(blocks).lower(example)
    whole = lowered.compile({"xla_tpu_sliced_prefetch_max_slices": 0}).cost_analysis()["optimal_seconds"]
    assert lowered.compile().cost_analysis()["optimal_seconds"] < 0 < whole
    steps = StepRegistry()
    steps.add([Step("blocks", jax.jit(blocks), lambda: (), assign(None), lambda: [example])])
    [step] = compile_steps(steps, "v6e-1", 0)
    assert 0.8 * whole < step.estimated_seconds < 1.2 * whole, (step.estimated_seconds, whole)


def test_targets_are_known():
    assert {"h100", "h200", "h100x8", "h200x8", "b200", "v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8", "v5p-8",
            "v4-8"} <= set(TARGETS)
    with pytest.raises(ValueError, match="unknown target 'v9'"):
        target_devices("v9")


@pytest.mark.parametrize("target", ["v6e-1", "h200"])
def test_a_target_is_traced_with_its_own_matmuls(target):
    """Compiling for a target from a CPU process traces the target's matmuls, not the CPU's blocked loops (the
    experts' tile loop was compiled for TPUs and GPUs while jax's backend, the CPU, chose it)."""
    from jaxserve.aot.targets import compiling_for
    from jaxserve.layers import matmul_blocks

    assert matmul_blocks.blocked_matmuls()
    with compiling_for(target):
        assert matmul_blocks.lowering_platform() == TARGETS[target].platform
        assert not matmul_blocks.blocked_matmuls()
        # libtpu crashed now and then compiling gpt-oss-20b's steps on two threads: a TPU compiles on one
        assert compile_threads(4) == {"tpu": 1, "gpu": 4}[TARGETS[target].platform]


def test_a_tpu_looks_the_embedding_up_in_place(tmp_path):
    """A hidden size that is not a multiple of 128 (gpt-oss's 2880) makes a TPU's default layout of the embedding
    table column-major, and looking up 8 tokens then copied the whole table in every step (1.08 GiB for
    gpt-oss-20b on one v6e). Pinned row-major, no step holds a copy of it."""
    config = tiny_hf_config("llama", hidden_size=320, intermediate_size=256, vocab_size=262144, head_dim=64)
    config.save_pretrained(tmp_path)
    result = compile_engine(EngineConfig(model=str(tmp_path), **{**SMALL, "max_num_seqs": 8,
                                                                 "decode_batch_buckets": (8,)}), "v6e-1", {"decode"})
    assert_compiles_and_fits(result)
    table = 262144 * 320 * 2  # over the chip's VMEM, where a smaller table's copy goes unseen
    assert all(step.temp_bytes < table for step in result.steps), [step.temp_bytes for step in result.steps]


def test_a_one_token_lookup_in_a_split_vocabulary_reads_each_devices_rows():
    """XLA made a one-row embedding lookup a dynamic slice, and on a vocabulary split over 8 GPUs each device then
    gathered the whole table in the decode step of one row (1.73 GiB for DeepSeek-V3's and Llama's 129k x 7168
    under -tp 8 on h200x8, more than the engine's activation reserve)."""
    config = tiny_hf_config("llama", hidden_size=320, intermediate_size=256, vocab_size=262144, head_dim=64,
                            num_attention_heads=8, num_key_value_heads=8)
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        options = {**SMALL, "decode_batch_buckets": (1, 4)}
        result = compile_engine(EngineConfig(model=directory, tensor_parallel_size=8, **options), "h200x8", {"decode"})
    assert_compiles_and_fits(result)
    table = 262144 * 320 * 2
    assert all(step.temp_bytes < table // 2 for step in result.steps), [step.temp_bytes for step in result.steps]


@pytest.mark.parametrize("target", ["h200x8", "v6e-4"])
def test_fp8_weights_compile_and_a_gpu_reads_them_in_place(target):
    """`--quantization fp8` under -tp 2. On GPU the decode and the short prefill run the Triton kernel on each
    device's part of every linear: XLA had written a dequantized copy of each kernel (o_proj's alone is 1 MiB a
    device here), and a Pallas call outside shard_map gathered the whole kernel onto every device."""
    config = tiny_hf_config("llama", hidden_size=1024, intermediate_size=4096, head_dim=128, num_attention_heads=8,
                            num_key_value_heads=8)
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        options = {**SMALL, "decode_batch_buckets": (1, 4)}
        result = compile_engine(EngineConfig(model=directory, tensor_parallel_size=2, quantization="fp8", **options),
                                target, {"prefill", "decode"})
    assert_compiles_and_fits(result)
    if target == "h200x8":
        assert all(step.temp_bytes < 1 << 20 for step in result.steps), [step.temp_bytes for step in result.steps]


@pytest.mark.parametrize("target, options", [("h200", {}), ("v6e-4", dict(tensor_parallel_size=4))])
def test_an_eagle3_head_compiles_from_its_config_alone(config_dirs, tmp_path, target, options):
    """The head's prefill, keep and propose steps and the target's forwards returning its layer inputs; a head
    directory with a config.json and no weights, as a model's."""
    import transformers

    from tests.eagle3_heads import head_hf_config

    llama = transformers.AutoConfig.from_pretrained(config_dirs["llama"])
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                                                  "num_hidden_layers": 1, **head_hf_config(
                                                      llama, draft_vocab_size=128, aux_layers=(0, 1, 1),
                                                      head_dim=64)}))
    config = EngineConfig(model=config_dirs["llama"], page_size=16 if target == "h200" else 128,
                          speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
                          **SMALL, **options)
    names = {"prefill", "decode", "verify", "head_prefill", "head_keep", "head_propose"}
    result = compile_engine(config, target, names)
    assert {step.name for step in result.steps} == names
    assert_compiles_and_fits(result)


@pytest.mark.parametrize("target", ["v6e-1", "h200"])
def test_an_image_model_compiles_its_vision_tower_and_fits(tmp_path, target):
    """Qwen2.5-VL from its config alone: the vision tower's encode step for every patch bucket up to transformers'
    default largest image (5120 patches), and on h200 the decoder's prefill (text and with image embeddings).
    The KV plan leaves room for the largest encode's temporaries (it did not: an H200 plan took every byte the
    decoder's steps left, and the encode step of 5120 patches did not fit)."""
    from jaxserve.models import qwen2_5_vit
    from tests.vision_models import tiny_qwen2_5_vl_config

    config = tiny_qwen2_5_vl_config(hidden_size=256, intermediate_size=256, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    config.vision_config.update(dict(out_hidden_size=256, hidden_size=64, num_heads=4))
    config.save_pretrained(tmp_path)
    steps = {"prefill", "encode"} if target == "h200" else {"encode"}  # the decoder's steps: the families' tests
    result = compile_engine(EngineConfig(model=str(tmp_path), **SMALL), target, steps)
    assert {step.name for step in result.steps} == steps
    assert max(int(step.shape.split("=")[1]) for step in result.steps if step.name == "encode") == 5120
    assert len([step for step in result.steps if step.name == "prefill"]) == \
        2 * len(result.plan.engine_config.prefill_shapes) * (target == "h200")  # text and with image embeddings
    assert not result.failed, result.verdict()
    assert result.fits, result.verdict()
    vision = qwen2_5_vit.parse_vision_config(config)
    for step in result.steps:  # the reserve for the encoder's temporaries holds what the compiler planned
        if step.name == "encode":
            assert step.temp_bytes + step.output_bytes <= qwen2_5_vit.activation_bytes(vision, 5120), step


@pytest.mark.parametrize("target", ["v6e-1", "h200"])
def test_a_gemma3_image_chunk_compiles_through_the_kernels(tmp_path, target):
    """Gemma 3 with images from its config alone: the decoder's prefill with image embeddings, whose query limits
    let an image's tokens see each other both ways, compiles with as many Pallas kernel calls as the text prefill
    (Mosaic TPU on v6e, Triton on h200; before the kernels took the limits it attended in XLA), sliding-window and
    global layers alike."""
    from jaxserve.aot.compile import plan_engine
    from jaxserve.aot.targets import compiling_for
    from tests.vision_models import tiny_gemma3_config

    config = tiny_gemma3_config(hidden_size=256, intermediate_size=256)
    config.text_config.head_dim = 128
    config.save_pretrained(tmp_path)
    engine = EngineConfig(model=str(tmp_path), **SMALL)
    result = compile_engine(engine, target, {"prefill"})
    assert len(result.steps) == 2 * len(result.plan.engine_config.prefill_shapes)  # text and with images
    assert_compiles_and_fits(result)
    _, runner = plan_engine(engine, target)
    kernel = "tpu_custom_call" if target == "v6e-1" else "jaxserve_ragged_paged"
    calls = {False: set(), True: set()}  # with query limits or not: the kernel calls of each prefill shape
    with compiling_for(target):
        for name, inputs in runner.steps.examples():
            if name == "prefill":
                text = runner.steps[name].fn.lower(*runner.steps[name].state(), inputs).as_text()
                calls[inputs.query_limits is not None].add(text.count(kernel))
    assert min(calls[False]) > 0 and calls[True] == calls[False], calls

"""`jaxserve serve` options: vLLM's flags map to the EngineConfig fields and server settings of the same meaning."""

from __future__ import annotations

import pytest

from jaxserve.loading import DEFAULT_MODEL
from jaxserve.server.cli_args import build_parser, engine_config, server_settings


def parse(*argv: str):
    args = build_parser().parse_args(list(argv))
    return engine_config(args), server_settings(args)


def test_vllm_engine_flags_reach_the_engine_config():
    config, _ = parse("--model", "/models/x", "--gpu-memory-utilization", "0.5", "--block-size", "32",
                      "--no-enable-prefix-caching", "--scheduling-policy", "priority", "--tokenizer", "/tok",
                      "--generation-config", "vllm", "--seed", "7", "--max-num-seqs", "3", "--max-model-len", "256",
                      "--max-num-batched-tokens", "64", "--num-kv-pages", "40", "--dtype", "bfloat16",
                      "--no-async-scheduling")
    assert config.async_scheduling is False
    assert (config.model, config.gpu_memory_utilization, config.page_size, config.enable_prefix_caching,
            config.scheduling_policy, config.tokenizer, config.generation_config, config.seed) == (
        "/models/x", 0.5, 32, False, "priority", "/tok", "vllm", 7)
    assert (config.max_num_seqs, config.max_model_len, config.max_num_batched_tokens, config.num_kv_pages,
            config.dtype) == (3, 256, 64, 40, "bfloat16")


def test_engine_flag_defaults_are_the_engine_config_defaults():
    from jaxserve.engine.config import EngineConfig

    config, _ = parse()
    default = EngineConfig()
    for field in ("model", "tokenizer", "generation_config", "gpu_memory_utilization", "page_size",
                  "enable_prefix_caching", "scheduling_policy", "seed", "max_num_seqs", "max_num_batched_tokens",
                  "async_scheduling"):
        assert getattr(config, field) == getattr(default, field), field
    assert parse("--enable-prefix-caching")[0].enable_prefix_caching is True


def test_one_flag_per_option():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--page-size", "16"])  # --block-size is the name


@pytest.mark.parametrize("argv, names", [
    ([], [DEFAULT_MODEL]),
    (["--model", "./ckpt/llama"], ["./ckpt/llama"]),  # the argument as given, as vLLM does
    (["--model", "/m", "--served-model-name", "alias"], ["alias"]),
    (["--served-model-name", "a", "b"], ["a", "b"]),
])
def test_served_model_names_are_known_before_loading(argv, names):
    assert parse(*argv)[1].served_model_names == names


def test_chat_template_from_a_file_or_literal(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert parse("--chat-template", str(path))[1].chat_template == template
    assert parse("--chat-template", template)[1].chat_template == template
    assert parse("--chat-template", r"{{ messages[0]['content'] }}\n")[1].chat_template == \
        "{{ messages[0]['content'] }}\n"  # escapes typed in a shell, as vLLM reads them
    assert parse()[1].chat_template is None


@pytest.mark.parametrize("value", ["no/such/template.jinja", "{% for m in messages %}"])
def test_bad_chat_templates_are_refused_at_start(value, capsys):
    with pytest.raises(SystemExit):
        parse("--chat-template", value)
    assert "chat-template" in capsys.readouterr().err


def test_server_flags_reach_the_settings():
    _, settings = parse("--api-key", "k", "--max-body-bytes", "99", "--log-stats-interval", "0")
    assert (settings.api_key, settings.max_body_bytes, settings.log_stats_interval) == ("k", 99, 0)


def test_speculative_config_flag_takes_vllm_json():
    config, _ = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    spec = config.resolve(2048).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (
        "ngram", 3, 5, 2)
    assert parse()[0].speculative_config is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}')

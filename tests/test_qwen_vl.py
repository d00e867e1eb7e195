"""Qwen2.5-VL and Qwen3-VL with images: the vision towers against transformers', greedy tokens against transformers'
`generate` on the same image processor's outputs (one and several images, images between text, chunked prefill
across an image, batching, preemption), the encoder cache, prefix caching keyed by the images, tensor parallelism,
the APIs (offline and over HTTP) and bad input. The tests after the first two use Qwen2.5-VL."""

from __future__ import annotations

import base64
import io
import logging

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import serve_app
from tests.vision_models import drawn_image, save_tiny_qwen2_5_vl

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def reference(model_dir: str):
    """transformers' model, image processor and tokenizer of a saved checkpoint."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, Qwen2VLImageProcessorPil.from_pretrained(model_dir), transformers.AutoTokenizer.from_pretrained(
        model_dir)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def hf(model_dir):
    return reference(model_dir)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def family(request, tmp_path_factory, model_dir, hf) -> tuple[str, tuple]:
    """Each family's checkpoint and its reference."""
    if request.param == "qwen2_5_vl":
        return model_dir, hf
    path = save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp(request.param)), family=request.param)
    return path, reference(path)


def image_prompt(hf, parts: list) -> tuple[list[int], list]:
    """Token ids with one vision block per image among text parts (strings), and the images in order."""
    _, _, tokenizer = hf
    config = hf[0].config
    ids, images = [], []
    for part in parts:
        if isinstance(part, str):
            ids += tokenizer.encode(part)
        else:
            ids += [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
            images.append(part)
    return ids, images


def hf_greedy(hf, ids: list[int], images: list) -> tuple[list[int], list[int]]:
    """transformers' expanded prompt (one placeholder per merged patch) and its greedy tokens."""
    import torch

    model, processor, _ = hf
    image_token = model.config.image_token_id
    expanded, kwargs = [], {}
    if images:
        features = processor(images=images, return_tensors="np")
        counts = iter((features["image_grid_thw"].prod(-1) // 4).tolist()) if images else iter(())
        kwargs = dict(pixel_values=torch.tensor(features["pixel_values"]),
                      image_grid_thw=torch.tensor(features["image_grid_thw"]))
    for token in ids:
        expanded += [token] * (next(counts) if token == image_token else 1)
    input_ids = torch.tensor([expanded])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             mm_token_type_ids=(input_ids == image_token).int(), max_new_tokens=MAX_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return expanded, out[0, len(expanded):].tolist()


def test_the_vision_tower_equals_transformers(family):
    """The encoder step over images whose patch grids split into whole and partial windows (and one window), each
    alone padded to its patch bucket and packed several to a call (up to the largest bucket, 256 patches), and over
    two devices, put back in raster order; Qwen3-VL's deepstack features beside its embeddings."""
    import torch

    from jaxserve.multimodal.inputs import ImageInput

    model_dir, hf = family
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=256, warmup=False)
    encoder, steps = llm.llm_engine.runner.encoder, llm.llm_engine.runner.steps
    processor = hf[1]
    images, expected = [], []
    for index, (width, height) in enumerate([(200, 120), (90, 300), (56, 56)]):
        features = processor(images=[drawn_image(width, height, seed=index)], return_tensors="np")
        grid = tuple(int(n) for n in features["image_grid_thw"][0])
        with torch.no_grad():
            out = hf[0].model.get_image_features(torch.tensor(features["pixel_values"]), torch.tensor([grid]))
        expected.append(np.concatenate(
            [out.pooler_output[0].numpy(),
             *(feature[0].numpy() for feature in getattr(out, "deepstack_features", None) or [])], axis=-1))
        images.append(ImageInput(f"test{index}", 0, len(expected[-1]), features["pixel_values"], grid))
    alone = [encoder.encode([image], steps)[0] for image in images]
    assert encoder.calls == 3
    packed = encoder.encode(images, steps)
    assert encoder.calls - 3 < len(images)
    split = LLM(model_dir, max_num_seqs=2, max_model_len=256, warmup=False, tensor_parallel_size=2)
    on_two = split.llm_engine.runner.encoder.encode(images, split.llm_engine.runner.steps)  # the tower split in two
    for ours, theirs in zip(alone + packed + on_two, expected * 3):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=2e-5)


def test_greedy_tokens_equal_transformers_with_images(family, caplog):
    """A batch of prompts with one image, two images between text, the same image twice, and none, in chunks of 32
    tokens (images split across chunks), with a pool small enough that sequences are preempted and recomputed (the
    images encoded again or found in the encoder cache); after warm-up nothing compiles."""
    model_dir, hf = family
    a, b, c = drawn_image(200, 120, seed=1), drawn_image(90, 150, seed=2), drawn_image(112, 112, seed=3)
    cases = [["Describe", a, "now."], ["First", b, "then", c, "and compare"], [a, "twice", a], ["text alone here"]]
    prompts = [image_prompt(hf, parts) for parts in cases]
    llm = LLM(model_dir, max_num_seqs=4, max_model_len=128, page_size=8, num_kv_pages=20,
              max_num_batched_tokens=32)
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.step_registry"):
        outputs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                                for ids, images in prompts], GREEDY, use_tqdm=False)
    for (ids, images), output in zip(prompts, outputs):
        expanded, expected = hf_greedy(hf, ids, images)
        assert output.prompt_token_ids == expanded
        assert output.outputs[0].token_ids == expected
    engine = llm.llm_engine
    assert engine.stats().num_preemptions > 0
    assert "while serving" not in caplog.text
    assert engine.runner.encoder.cache.hits > 0  # the repeated image, and the chunks after an image's first


def test_prefix_cache_keys_include_the_image(model_dir, hf):
    """Two requests with the same text and different images share no page holding an image token (a hit there
    would give the first image's K/V to the second); the same image and text hit; outputs stay transformers'."""
    a, b = drawn_image(200, 120, seed=4), drawn_image(200, 120, seed=5)
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=256, page_size=8, warmup=False)
    ids, _ = image_prompt(hf, ["a long shared preamble of text", a, "what is it"])
    first_image = ids.index(hf[0].config.image_token_id)
    results = {}
    for name, image in (("a", a), ("b", b), ("a again", a)):
        (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY,
                                 use_tqdm=False)
        results[name] = output
        assert output.outputs[0].token_ids == hf_greedy(hf, ids, [image])[1]
    assert results["a"].outputs[0].token_ids != results["b"].outputs[0].token_ids
    assert results["b"].num_cached_tokens == first_image // 8 * 8  # the text pages before the image only
    image_token = hf[0].config.image_token_id
    last_image = max(i for i, token in enumerate(results["a"].prompt_token_ids) if token == image_token)
    assert results["a again"].num_cached_tokens > last_image  # through the image
    assert llm.llm_engine.runner.encoder.images_encoded == 2


def test_kv_tiers_key_pages_by_the_images(model_dir, hf, tmp_path):
    """The host and disk tiers keep pages under the prefix cache's keys: once other requests took the device pool,
    the same image and text hit the tiers through the image, a different image with the same text only before it;
    a restarted engine finds them on disk; outputs stay transformers'."""
    a, b = drawn_image(200, 120, seed=4), drawn_image(200, 120, seed=5)
    ids, _ = image_prompt(hf, ["a long shared preamble of text", a, "what is it"])
    options = dict(max_num_seqs=1, max_model_len=96, page_size=8, num_kv_pages=14, warmup=False,
                   kv_offloading_dir=str(tmp_path))

    def generate(llm, image):
        (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY,
                                 use_tqdm=False)
        assert output.outputs[0].token_ids == hf_greedy(hf, ids, [image])[1]
        return output

    image_token = hf[0].config.image_token_id
    llm = LLM(model_dir, **options, kv_offloading_size=0.01)
    first = generate(llm, a)
    image_tokens = [i for i, token in enumerate(first.prompt_token_ids) if token == image_token]
    assert generate(llm, b).num_cached_tokens == image_tokens[0] // 8 * 8
    generate(llm, b)  # b's pages take the device pool
    assert generate(llm, a).num_cached_tokens > image_tokens[-1]
    host = dict((tier, (q, h)) for tier, q, h in llm.llm_engine.stats().external_prefix_cache)["host"]
    assert host[1] > 0
    llm.llm_engine.shutdown()
    restarted = LLM(model_dir, **options)
    assert generate(restarted, a).num_cached_tokens > image_tokens[-1]
    disk = dict((tier, (q, h)) for tier, q, h in restarted.llm_engine.stats().external_prefix_cache)["disk"]
    assert disk[1] > 0


def test_lora_adapters_of_the_language_model_serve_images(model_dir, hf, tmp_path):
    """A PEFT adapter of the image + text checkpoint's decoder (its tensors under `model.language_model.`) with
    images, beside the base model in one batch: greedy tokens equal PEFT's; an adapter that also adapts the vision
    tower's MLP is refused naming the tensor."""
    import peft
    import torch

    from jaxserve import LoRARequest
    from tests.test_lora import save_peft_adapter

    def save(path: str, targets: list[str]) -> str:
        return save_peft_adapter(model_dir, path, 0, type(hf[0]), r=4, lora_alpha=8, target_modules=targets)

    adapter = save(str(tmp_path / "attention"), ["q_proj", "v_proj", "o_proj"])
    image = drawn_image(200, 120, seed=6)
    ids, images = image_prompt(hf, ["Describe", image, "now."])
    peft_model = peft.PeftModel.from_pretrained(type(hf[0]).from_pretrained(model_dir, dtype=torch.float32), adapter)
    expected = [hf_greedy((peft_model.eval(), *hf[1:]), ids, images)[1], hf_greedy(hf, ids, images)[1]]
    assert expected[0] != expected[1]
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=128, enable_lora=True, max_lora_rank=4, warmup=False)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    outputs = llm.generate([prompt, prompt], GREEDY, lora_request=[LoRARequest("a", 1, adapter), None],
                           use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    tower = save(str(tmp_path / "tower"), ["q_proj", "gate_proj"])
    with pytest.raises(ValueError, match=r"visual\.blocks\.\d+\.mlp\.gate_proj"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("tower", 2, tower), use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[1]


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def test_bad_image_input_is_a_clear_error_and_the_engine_keeps_serving(model_dir, hf, tmp_path):
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=256, warmup=False, limit_mm_per_prompt={"image": 2})
    ids, _ = image_prompt(hf, ["look", drawn_image(60, 60)])  # 56x56 once resized: 16 patches, 4 tokens
    pad = ids.index(hf[0].config.image_token_id)
    image = drawn_image(60, 60)
    data = png_bytes(image)
    cases = {
        "2 images were given": {"prompt_token_ids": ids, "multi_modal_data": {"image": [image, image]}},
        "0 images were given": {"prompt_token_ids": ids},
        "at most 2 are allowed": {"prompt_token_ids": ids, "multi_modal_data": {"image": [image] * 3}},
        "does not decode": {"prompt_token_ids": ids, "multi_modal_data": {"image": data[:len(data) // 2]}},
        "not an image": {"prompt_token_ids": ids, "multi_modal_data": {"image": b"GIF89a but not really"}},
        "base64 does not decode": {"prompt_token_ids": ids, "multi_modal_data": {"image": "data:image/png;base64,@@"}},
        "no local media path": {"prompt_token_ids": ids, "multi_modal_data": {"image": f"file://{tmp_path}/x.png"}},
        "modality 'video'": {"prompt_token_ids": ids, "multi_modal_data": {"video": image}},
        "takes 4 placeholder tokens, the prompt has 3": {"prompt_token_ids": ids[:pad] + ids[pad:pad + 1] * 3 +
                                                         ids[pad + 1:], "multi_modal_data": {"image": image}},
    }
    for message, prompt in cases.items():
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    encoded = "data:image/png;base64," + base64.b64encode(data).decode()
    (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": encoded}}, GREEDY,
                             use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(hf, ids, [image])[1]
    from jaxserve import GuidedDecodingParams  # constrained decoding after an image

    guided = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, guided, use_tqdm=False)
    assert output.outputs[0].text in ("yes", "no")


def test_an_image_on_a_text_model_is_refused(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_num_seqs=2, max_model_len=64, warmup=False)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": drawn_image(30, 30)}}, GREEDY)


def collapse(ids: list[int], image_token: int) -> list[int]:
    """A prompt with each run of image placeholders back to one (what a template writes)."""
    return [token for index, token in enumerate(ids) if token != image_token or ids[index - 1] != image_token]


def test_chat_with_images_over_http(model_dir, hf, tmp_path):
    """OpenAI chat with a data: URL, a local http URL (fetched; the same picture, so the encoder cache serves it)
    and a file: URL under --allowed-local-media-path; the Responses API's input_image; /tokenize counting each
    image's tokens; bad images a 400 naming the problem, and the server keeps serving."""
    import http.server
    import threading

    import httpx

    from jaxserve.engine.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server.async_engine import AsyncEngine

    image = drawn_image(150, 100, seed=6)
    data = png_bytes(image)
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "picture.png").write_bytes(data)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/elsewhere":  # a redirect to another scheme
                self.send_response(302)
                self.send_header("Location", "ftp://127.0.0.1/picture.png")
                self.end_headers()
                return
            found = self.path == "/picture.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(data if found else b"")

        def log_message(self, *args):
            pass

    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    config = EngineConfig(model=model_dir, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64,
                          limit_mm_per_prompt={"image": 1}, allowed_local_media_path=str(tmp_path / "media"))
    engine = AsyncEngine(lambda: LLMEngine(config), max_waiting=4)
    image_token = hf[0].config.image_token_id
    data_url = "data:image/png;base64," + base64.b64encode(data).decode()

    def chat(url: str, text: str = "what is this?") -> dict:
        return {"model": "vl", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]}

    async def check(http: httpx.AsyncClient) -> None:
        # different text before the image each time: no prefix hit reaches the image, the encoder cache serves it
        answers = [(await http.post("/v1/chat/completions", json=chat(url, text))).json()
                   for url, text in ((data_url, "what is this?"), (f"{base}/picture.png", "and this one?"),
                                     (f"file://{tmp_path}/media/picture.png", "or this"))]
        for answer in answers:
            prompt = answer["prompt_token_ids"]
            assert (prompt, answer["choices"][0]["token_ids"]) == hf_greedy(hf, collapse(prompt, image_token),
                                                                            [image])
            assert answer["usage"]["prompt_tokens"] == len(prompt)
        expected = (answers[0]["prompt_token_ids"], answers[0]["choices"][0]["token_ids"])
        assert engine.llm_engine.runner.encoder.images_encoded == 1
        response = (await http.post("/v1/responses", json={
            "model": "vl", "max_output_tokens": MAX_TOKENS, "temperature": 0, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": data_url}]}]}))
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["input_tokens"] == len(expected[0])
        counted = (await http.post("/tokenize", json=chat(data_url))).json()
        assert counted["count"] == len(expected[0])
        bad = {"base64 does not decode": chat("data:image/png;base64,@@@"),
               "answered HTTP 404": chat(f"{base}/missing.png"),
               "only http(s) redirects are followed": chat(f"{base}/elsewhere"),
               "outside the allowed local media path": chat(f"file://{tmp_path}/elsewhere.png"),
               "does not decode": chat("data:image/png;base64," + base64.b64encode(data[:300]).decode()),
               "at most 1 are allowed": {**chat(data_url), "messages": [{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": data_url}}] * 2}]},
               "has type 'audio_url'": {**chat(data_url), "messages": [{"role": "user", "content": [
                   {"type": "audio_url", "audio_url": {"url": data_url}}]}]}}
        for message, body in bad.items():
            answer = await http.post("/v1/chat/completions", json=body)
            assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
        again = (await http.post("/v1/chat/completions", json=chat(data_url))).json()
        assert again["choices"][0]["token_ids"] == expected[1]
        lines = (await http.get("/metrics")).text.splitlines()
        metrics = {line.split("{")[0]: float(line.split()[-1]) for line in lines
                   if line.startswith(("jaxserve:images_encoded", "jaxserve:encoder_cache"))}
        assert metrics["jaxserve:images_encoded_total"] == 1
        assert 0 < metrics["jaxserve:encoder_cache_hits_total"] < metrics["jaxserve:encoder_cache_queries_total"]

    try:
        serve_app(engine, check, "vl")
    finally:
        files.shutdown()


def test_llm_chat_takes_image_parts(model_dir, hf):
    """`LLM.chat` with vLLM's image_pil and image_url parts renders the template's placeholders and serves the
    images."""
    image = drawn_image(100, 160, seed=7)
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=256, warmup=False)
    encoded = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    outputs = [llm.chat([{"role": "user", "content": [{"type": "text", "text": "look"}, part]}], GREEDY,
                        use_tqdm=False)[0]
               for part in ({"type": "image_pil", "image_pil": image},
                            {"type": "image_url", "image_url": {"url": encoded}})]
    image_token = hf[0].config.image_token_id
    expected = hf_greedy(hf, collapse(outputs[0].prompt_token_ids, image_token), [image])
    for output in outputs:
        assert (output.prompt_token_ids, output.outputs[0].token_ids) == expected


def test_tensor_parallel_serves_images_as_one_device(model_dir, hf):
    """Over 2 devices (the decoder's heads split, and the vision tower's: each block's q/k/v and MLP by output,
    their last linears by input) the tokens are transformers'."""
    a, b = drawn_image(120, 90, seed=8), drawn_image(64, 200, seed=9)
    prompts = [image_prompt(hf, ["one", a, "and", b]), image_prompt(hf, [b, "alone"])]
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=32, tensor_parallel_size=2,
              warmup=False)
    block = llm.llm_engine.runner.encoder.vision.params["blocks"][0]
    assert [tuple(block[name]["kernel"].sharding.spec) for name in ("qkv", "proj", "gate_proj", "down_proj")] == [
        (None, None, "model"), ("model", None), (None, "model"), ("model", None)]
    outputs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                            for ids, images in prompts], GREEDY, use_tqdm=False)
    for (ids, images), output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, ids, images)[1]


def test_ngram_speculation_keeps_the_images_positions(model_dir, hf):
    """n-gram drafts verified after an image: each verify step turns its tokens by their positions plus the
    sequence's M-RoPE delta; greedy tokens stay transformers' with drafts accepted."""
    image = drawn_image(200, 120, seed=10)
    ids, images = image_prompt(hf, ["repeat after me", image, "again and again"])
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=256, warmup=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                  "prompt_lookup_min": 1, "disable_by_batch_size": None})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, params,
                             use_tqdm=False)
    import torch

    model = hf[0]
    features = hf[1](images=images, return_tensors="np")
    expanded = output.prompt_token_ids
    input_ids = torch.tensor([expanded])
    with torch.no_grad():
        expected = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=torch.tensor(
                features["pixel_values"]), image_grid_thw=torch.tensor(features["image_grid_thw"]),
            mm_token_type_ids=(input_ids == model.config.image_token_id).int(), max_new_tokens=24, do_sample=False,
            eos_token_id=None, pad_token_id=0)[0, len(expanded):].tolist()
    assert output.outputs[0].token_ids == expected
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0

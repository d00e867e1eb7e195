"""Gemma 3 with images: the SigLIP tower and projector against transformers', greedy tokens against transformers'
`generate` (each image's tokens attending to each other both ways, inside causal text), under chunked prefill that
never splits an image, batching and preemption, on the xla backend and the interpreted Pallas ones."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.vision_models import drawn_image, save_tiny_gemma3

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(hf, processor, expanded: list[int], images: list) -> list[int]:
    import torch

    model = hf[0]
    input_ids = torch.tensor([expanded])
    kwargs = dict(pixel_values=torch.tensor(np.stack([processor.preprocess(image) for image in images]))) \
        if images else {}
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             token_type_ids=(input_ids == model.config.image_token_id).long(),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(expanded):].tolist()


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_the_tower_and_projector_equal_transformers(model_dir, hf, tensor_parallel_size):
    """On one device, and over two (each layer's q/k/v and first MLP linear split by output, the last ones by
    input)."""
    import torch

    llm = LLM(model_dir, max_num_seqs=2, max_model_len=128, attention_backend="xla", warmup=False,
              tensor_parallel_size=tensor_parallel_size)
    encoder = llm.llm_engine.runner.encoder
    layer = encoder.vision.params["layers"][0]
    assert tuple(layer["q_proj"]["kernel"].sharding.spec) == ((None, "model") if tensor_parallel_size == 2 else ())
    processor = llm.llm_engine.model.vision.processor
    from jaxserve.multimodal.inputs import ImageInput

    for index, image in enumerate([drawn_image(150, 90, seed=1), drawn_image(40, 200, seed=2)]):
        pixels = processor.preprocess(image)
        with torch.no_grad():
            expected = hf[0].model.get_image_features(torch.tensor(pixels[None])).pooler_output[0].numpy()
        (ours,) = encoder.encode([ImageInput(f"gemma{index}", 0, 16, pixels, (1, 8, 8))], llm.llm_engine.runner.steps)
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=2e-5)


def test_greedy_tokens_equal_transformers_with_images(model_dir, hf):
    """Prompts with one image, two images between text, and none, in chunks of 16 tokens (an image's 16 tokens take
    a chunk of their own: the text before them waits for the next chunk rather than splitting them), batched,
    with a pool small enough that sequences are preempted."""
    _, tokenizer = hf
    boi = hf[0].config.boi_token_id
    a, b = drawn_image(150, 90, seed=3), drawn_image(60, 120, seed=4)
    cases = [(tokenizer.encode("describe") + [boi] + tokenizer.encode("now"), [a]),
             (tokenizer.encode("describe") + [boi] + tokenizer.encode("now"), [b]),
             (tokenizer.encode("one") + [boi] + tokenizer.encode("and two") + [boi] + tokenizer.encode("!"), [b, a]),
             (tokenizer.encode("just some text"), [])]
    llm = LLM(model_dir, max_num_seqs=4, max_model_len=64, page_size=8, num_kv_pages=12,
              max_num_batched_tokens=16, attention_backend="xla")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} for ids, images in cases],
                           params, use_tqdm=False)
    processor = llm.llm_engine.model.vision.processor
    for (ids, images), output in zip(cases, outputs):
        assert output.prompt_token_ids.count(hf[0].config.image_token_id) == 16 * len(images)
        assert output.outputs[0].token_ids == hf_greedy(hf, processor, output.prompt_token_ids, images)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the image decides
    assert llm.llm_engine.stats().num_preemptions > 0


def test_prompts_with_images_are_the_ids_transformers_processor_makes_on_a_tokenizer_merging_newlines(model_dir, hf):
    """The image's `\\n\\n` merge with the template's newline before it (`\\n\\n\\n` one token) and split
    before the text after it: expanded in the text, as transformers' `Gemma3Processor` does, the ids are its own;
    spliced into the template's ids they were not. Through `chat`, and a text prompt given with its images."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    theirs = transformers.Gemma3Processor(transformers.AutoImageProcessor.from_pretrained(model_dir), tokenizer,
                                          image_seq_length=16)
    image = drawn_image(150, 90, seed=3)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert "user\n<start_of_image>what" in text
    expected = theirs(text=text, images=[image], add_special_tokens=False)["input_ids"][0]
    assert tokenizer.encode("\n\n\n", add_special_tokens=False) == [expected[expected.index(
        hf[0].config.boi_token_id) - 1]]  # the merge this test is about
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=128, attention_backend="xla", warmup=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (chat,) = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                     {"type": "text", "text": "what is it?"}]}], params, use_tqdm=False)
    assert chat.prompt_token_ids == expected
    assert chat.outputs[0].token_ids == hf_greedy(hf, llm.llm_engine.model.vision.processor, expected, [image])
    with_bos = theirs(text=text, images=[image])["input_ids"][0]
    (plain,) = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False)
    assert plain.prompt_token_ids == with_bos


def assert_prompt_scores_equal_transformers(llm, hf, ids: list[int], image) -> list[int]:
    """Every prompt token's logprob (scored by `llm`) against transformers' forward; returns the expanded prompt."""
    import torch

    model = hf[0]
    (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}},
                             SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    prompt = output.prompt_token_ids
    input_ids = torch.tensor([prompt])
    processor = llm.llm_engine.model.vision.processor
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                       token_type_ids=(input_ids == model.config.image_token_id).long(),
                       pixel_values=torch.tensor(processor.preprocess(image)[None])).logits[0]
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(len(prompt) - 1), prompt[1:]].numpy()
    ours = np.array([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])])
    np.testing.assert_allclose(ours, expected, atol=2e-4)
    return prompt


def test_prompt_scores_equal_transformers_when_an_image_would_straddle_chunks(model_dir, hf):
    """Every prompt token's logprob against transformers' forward: in chunks of 16 tokens the image (tokens 11-26)
    would straddle two chunks, whose first half could not see its second; the chunk stops before it instead."""
    model, tokenizer = hf
    ids = tokenizer.encode("describe") + [model.config.boi_token_id] + tokenizer.encode("now")
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=64, page_size=8, max_num_batched_tokens=16,
              attention_backend="xla", warmup=False)
    prompt = assert_prompt_scores_equal_transformers(llm, hf, ids, drawn_image(150, 90, seed=3))
    assert prompt.index(model.config.image_token_id) % 16  # the image does not start a chunk of 16


@pytest.mark.parametrize("backend", ["pallas-interpret", "pallas-tpu-interpret"])
def test_the_pallas_kernels_attend_to_a_chunk_holding_an_image(model_dir, hf, backend):
    """The Pallas kernels take the queries' limits: a prefill chunk that holds a Gemma 3 image runs them too (on
    TPU, heads padded to 128 lanes), its image tokens seeing each other both ways; every prompt token's logprob
    equals transformers'."""
    ids = hf[1].encode("describe") + [hf[0].config.boi_token_id] + hf[1].encode("now")
    llm = LLM(model_dir, max_num_seqs=2, max_model_len=64, page_size=16, attention_backend=backend, warmup=False)
    assert_prompt_scores_equal_transformers(llm, hf, ids, drawn_image(150, 90, seed=3))

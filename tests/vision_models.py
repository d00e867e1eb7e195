"""Tiny random-weight image + text checkpoints for the image tests: Qwen2.5-VL and Qwen3-VL models built by
transformers, their tokenizer with the vision tokens and a chat template that writes image placeholders, their
image processor (small `max_pixels`, so images have tens of patches), and test images drawn with Pillow."""

from __future__ import annotations

import numpy as np

from tests.conftest import TINY_DIMS, save_tiny_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen2_5_vl_config(**overrides):
    import transformers

    vocab = TINY_DIMS["vocab_size"]
    text = {**TINY_DIMS, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "eos_token_id": 0, "bos_token_id": None, **overrides}
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1], in_channels=3)
    first = vocab - len(VISION_TOKENS)  # the tokenizer's last tokens
    return transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vision_start_token_id=first, vision_end_token_id=first + 1,
        image_token_id=first + 2, video_token_id=first + 3, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=0)


def tiny_qwen3_vl_config(**overrides):
    """Qwen3-VL: q/k norms, interleaved M-RoPE, 16-pixel patches, a learned position table of 8x8, deepstack
    features from two of the tower's three blocks."""
    import transformers

    vocab = TINY_DIMS["vocab_size"]
    text = {**TINY_DIMS, "num_hidden_layers": 3, "head_dim": 16, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        **overrides}
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=TINY_DIMS["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1], in_channels=3)
    first = vocab - len(VISION_TOKENS)
    return transformers.Qwen3VLConfig(
        text_config=text, vision_config=vision, vision_start_token_id=first, vision_end_token_id=first + 1,
        image_token_id=first + 2, video_token_id=first + 3, tie_word_embeddings=False)


TINY_VL = {"qwen2_5_vl": (tiny_qwen2_5_vl_config, 14), "qwen3_vl": (tiny_qwen3_vl_config, 16)}


def save_tiny_qwen2_5_vl(path: str, seed: int = 0, max_pixels: int = 28 * 28 * 64, family: str = "qwen2_5_vl",
                         **text_overrides) -> str:
    """A Qwen-VL checkpoint of random weights (larger than transformers' init, so images change the outputs), its
    tokenizer and its image processor (images of up to `max_pixels`: 256 patches, 64 tokens by default)."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(seed)
    make_config, patch = TINY_VL[family]
    config = make_config(**text_overrides)
    model = transformers.AutoModelForImageTextToText.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 or name.endswith("bias"):
                param.normal_(0.0, 0.08)
            elif "norm" in name or "ln_q" in name:
                param.normal_(1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path, config.text_config.vocab_size, VISION_TOKENS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    tokenizer.save_pretrained(path)
    factor = patch * 2
    Qwen2VLImageProcessorPil(min_pixels=factor * factor * 4, max_pixels=max_pixels * factor ** 2 // 28 ** 2,
                             patch_size=patch).save_pretrained(path)
    return path


def drawn_image(width: int, height: int, seed: int = 0):
    """An RGB image of smooth gradients and noise (so nearby patches differ), drawn from `seed`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width * 255, y / height * 255, (x + y) % 97 * 2.6], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


GEMMA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA_NEWLINES = (("Ċ", "Ċ"), ("ĊĊ", "Ċ"))  # runs of newlines are single tokens, as in Gemma's own tokenizer
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def tiny_gemma3_config(**text_overrides):
    """Gemma 3 image + text: Gemma 3's tiny text decoder (a 16-token window; `text_overrides` on top), a 2-layer
    SigLIP tower over 112-pixel images (8x8 patches of 14) pooled to 16 tokens per image."""
    import transformers

    from tests.conftest import tiny_hf_config

    text = tiny_hf_config("gemma3_text", **text_overrides).to_dict()
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=112,
                  patch_size=14, layer_norm_eps=1e-6, vision_use_head=False)
    first = TINY_DIMS["vocab_size"] - len(GEMMA_TOKENS)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                                     boi_token_index=first, eoi_token_index=first + 1, image_token_index=first + 2)


def save_tiny_gemma3(path: str, seed: int = 0) -> str:
    """A Gemma 3 image + text checkpoint of random weights (`tiny_gemma3_config`)."""
    import torch
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    torch.manual_seed(seed)
    vocab = TINY_DIMS["vocab_size"]
    config = tiny_gemma3_config()
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 or name.endswith("bias"):
                param.normal_(0.0, 0.08)
            else:
                param.normal_(0.0 if "norm" in name and "vision" not in name else 1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path, vocab, GEMMA_TOKENS, GEMMA_NEWLINES)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 112, "width": 112}, image_mean=[0.5] * 3,
                            image_std=[0.5] * 3).save_pretrained(path)
    return path

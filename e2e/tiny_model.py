"""A tiny, random-weight Qwen2-VL that real vLLM serves on a CPU in seconds.

No model hub is reachable here, so tests and the demo build their model
locally. The build is deterministic (fixed seed, fixed tokenizer corpus), so
two builds give the same bytes and token ids can be compared across runs.

    python -m e2e.tiny_model OUT_DIR      # build into OUT_DIR
    ensure_tiny_model()                   # cached build, returns its path

Shape: text hidden 128 (head_dim 64, which vLLM's CPU attention supports),
2 layers; vision depth 2, embed 64, merger output 128 = encoder output width.
A 112x112 image is 8x8 patches of 14 px, 16 LM tokens after the 2x2 merge.

``ENCODER_HEAVY`` is a second variant for serving benchmarks: the same LM and
tokenizer, but a deeper, wider vision tower and larger images allowed, so
encoding dominates a request as it does for real VLMs (benchmarks/epd_serving.py).
Its encoder output width is still ``HIDDEN``. It is cached in a directory of its
own; the default model's bytes do not change.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED = 1234
HIDDEN = 128  # LM hidden size == vision merger output == encoder output width
MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224
SERVED_NAME = "tiny-qwen2vl"


@dataclass(frozen=True)
class Variant:
    """What differs between the built models: the vision tower and the largest image."""

    name: str  # cache directory prefix
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_heads: int = 2
    vision_mlp_ratio: int = 2
    max_pixels: int = MAX_PIXELS


TINY = Variant("tiny-qwen2vl")
# 448x448 images: 32x32 patches, 256 LM tokens after the merge. Vision head_dim 64.
ENCODER_HEAVY = Variant(
    "tiny-qwen2vl-encoder-heavy",
    vision_depth=4,
    vision_embed_dim=256,
    vision_heads=4,
    vision_mlp_ratio=4,
    max_pixels=448 * 448,
)

# Qwen2's pre-tokenizer split; BPE trained on a tiny corpus keeps the vocab small.
_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_CORPUS = [
    "You are a helpful assistant.",
    "Describe this image. What is in the picture? What color is it?",
    "The quick brown fox jumps over the lazy dog. A red square on a blue background.",
    "system user assistant image video picture describe color shape red green blue",
    "Hello, world! 0 1 2 3 4 5 6 7 8 9 . , ; : ? ! ' \" ( ) [ ] { }",
] * 20

_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(
        models.BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(_CORPUS, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = model["vocab"]
    for token in _SPECIAL:  # ids 320.. in Qwen's order
        vocab[token] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        split_special_tokens=False,
    )
    tok.add_special_tokens({"additional_special_tokens": _SPECIAL})
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def build(out: Path, variant: Variant = TINY) -> Path:
    """Write the model, tokenizer and processor to ``out`` (replaced if present)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tok = _tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in _SPECIAL}
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": variant.max_pixels}
    patching = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    # Qwen2VLProcessor cannot be built (nor loaded by vLLM) without a video
    # processor, and that needs torchvision.
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **patching),
        video_processor=Qwen2VLVideoProcessor(size=size, **patching),
        tokenizer=tok,
        chat_template=_CHAT_TEMPLATE,
    )
    heads = 2
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tok),  # every sampled id decodes to text
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": 1,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            # sum(mrope_section) must equal head_dim // 2
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [8, 12, 12],
            },
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
            "tie_word_embeddings": False,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "initializer_range": 0.02,
        },
        vision_config={
            "depth": variant.vision_depth,
            "embed_dim": variant.vision_embed_dim,
            "num_heads": variant.vision_heads,
            "mlp_ratio": variant.vision_mlp_ratio,
            "hidden_size": HIDDEN,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "hidden_act": "quick_gelu",
            "initializer_range": 0.02,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    assert sum(config.text_config.rope_parameters["mrope_section"]) == HIDDEN // heads // 2
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    gen = model.generation_config
    gen.bos_token_id = ids["<|endoftext|>"]
    gen.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    gen.pad_token_id = ids["<|endoftext|>"]
    gen.do_sample = False

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def cache_dir() -> Path:
    root = os.environ.get("ENCODERPOOL_CACHE") or Path.home() / ".cache" / "encoderpool"
    return Path(root)


def ensure_tiny_model(variant: Variant = TINY) -> Path:
    """Build once per version of this file; later calls return the cached copy."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{variant.name}-{digest}"
    if (out / ".complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (make test runs two pytest processes): the second waits,
    # then finds the model built.
    with open(out.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / ".complete").exists():
            return out
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        build(tmp, variant)
        (tmp / ".complete").touch()
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


def ensure_encoder_heavy_model() -> Path:
    """The cached ``ENCODER_HEAVY`` build (the serving benchmark's model)."""
    return ensure_tiny_model(ENCODER_HEAVY)


if __name__ == "__main__":
    args = sys.argv[1:]
    variant = TINY
    if args and args[0] == "--encoder-heavy":
        variant, args = ENCODER_HEAVY, args[1:]
    path = build(Path(args[0]), variant) if args else ensure_tiny_model(variant)
    print(path)

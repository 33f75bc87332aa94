"""Deterministic test images, videos and OpenAI request bodies for the tiny model.

Images are small PNGs: 112x112 is 8x8 patches of 14 px, so 16 LM tokens after
the 2x2 merge. Videos are a few JPEG frames sent as one ``video/jpeg`` data URL
(vLLM's frame-list form: no video decoder involved, so any vLLM build reads
them): 4 frames of 112x112 are 2 temporal patches of 8x8, 32 LM tokens. Requests
decode greedily and ask for ``token_ids`` so outputs
compare exactly across servers (logprobs are left out on purpose: the first
request asking for them triggers a 10-18 s compile on CPU).
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

MODEL = "tiny-qwen2vl"


def _picture(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    im = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(im)
    w, h = size
    for _ in range(3):
        x0, y0 = rng.randrange(w - 8), rng.randrange(h - 8)
        box = (x0, y0, rng.randrange(x0 + 4, w), rng.randrange(y0 + 4, h))
        fill = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    return im


def image(index: int, size: tuple[int, int] = (112, 112)) -> bytes:
    """PNG bytes of the index-th test image: the same bytes for the same index."""
    buf = io.BytesIO()
    _picture(random.Random(index), size).save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class Video:
    """A test video: its frames as JPEG bytes, in order."""

    frames: tuple[bytes, ...]

    def data_url(self) -> str:
        """vLLM's frame-list data URL: ``data:video/jpeg;base64,<frame>,<frame>,...``."""
        return "data:video/jpeg;base64," + ",".join(
            base64.b64encode(f).decode() for f in self.frames
        )


def video(index: int, frames: int = 4, size: tuple[int, int] = (112, 112)) -> Video:
    """The index-th test video: the same frames for the same index, none alike across
    indices (its seed space is apart from ``image``'s). Frames share a background and
    their shapes drift, so the video is not a slideshow of unrelated pictures; an even
    count fills whole temporal patches (Qwen2-VL merges frame pairs)."""
    rng = random.Random(f"video-{index}")
    base = _picture(rng, size)
    out = []
    for _ in range(frames):
        frame = base.copy()
        draw = ImageDraw.Draw(frame)
        x0, y0 = rng.randrange(size[0] - 16), rng.randrange(size[1] - 16)
        fill = tuple(rng.randrange(256) for _ in range(3))
        draw.rectangle((x0, y0, x0 + 15, y0 + 15), fill=fill)
        buf = io.BytesIO()
        frame.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return Video(tuple(out))


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_part(png: bytes, uuid: str | None = None) -> dict[str, Any]:
    """An OpenAI content part; ``uuid`` sets vLLM's item id (it replaces the mm_hash)."""
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(png)}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def video_part(clip: Video, uuid: str | None = None) -> dict[str, Any]:
    """A ``video_url`` content part; ``uuid`` as for ``image_part``."""
    part: dict[str, Any] = {"type": "video_url", "video_url": {"url": clip.data_url()}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def media_part(item: bytes | Video, uuid: str | None = None) -> dict[str, Any]:
    """The content part of an image (PNG bytes) or a ``Video``."""
    return video_part(item, uuid) if isinstance(item, Video) else image_part(item, uuid)


def chat_request(
    *media: bytes | Video,
    text: str = "Describe this image.",
    max_tokens: int = 8,
    stream: bool = False,
    uuids: list[str | None] | None = None,
) -> dict[str, Any]:
    """A greedy chat request with the given images (PNG bytes) and videos, in that
    order, followed by ``text``."""
    ids = uuids or [None] * len(media)
    content = [media_part(item, uuid) for item, uuid in zip(media, ids, strict=True)]
    content.append({"type": "text", "text": text})
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "return_token_ids": True,
    }
    if stream:
        body["stream"] = True
    return body


def responses_input(png: bytes, text: str = "Describe this image.") -> list[dict[str, Any]]:
    """A Responses API ``input``: one user message with an image and ``text``."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": data_url(png), "detail": "auto"},
                {"type": "input_text", "text": text},
            ],
        }
    ]


def anthropic_messages(
    png: bytes, source: str, text: str = "Describe this image."
) -> list[dict[str, Any]]:
    """Anthropic Messages ``messages``: one user message with an image (``source``
    ``base64`` or ``url``, a data URL) and ``text``."""
    data = base64.b64encode(png).decode()
    block = (
        {"type": "base64", "media_type": "image/png", "data": data}
        if source == "base64"
        else {"type": "url", "url": data_url(png)}
    )
    return [
        {
            "role": "user",
            "content": [{"type": "image", "source": block}, {"type": "text", "text": text}],
        }
    ]


def encoder_request(part: dict[str, Any], model: str = MODEL) -> dict[str, Any]:
    """What a router sends a producer for one media item: encode it, decode nothing."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
        "stream": False,
    }


def media_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The media items of a chat request, in order."""
    kinds = {"image_url", "audio_url", "input_audio", "video_url"}
    return [
        part
        for msg in body.get("messages", [])
        if isinstance(msg.get("content"), list)
        for part in msg["content"]
        if part.get("type") in kinds
    ]


def token_ids(response: dict[str, Any]) -> list[int]:
    """The generated token ids of a non-streaming chat response."""
    ids = response["choices"][0].get("token_ids")
    assert ids is not None, f"response carries no token_ids: {response}"
    return list(ids)

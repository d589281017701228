"""``decode_video``: a video member to ``num_frames`` uint8 RGB frames ``(T, H, W, 3)``
(PyAV), chosen evenly over the clip: the same frames for the same bytes, always."""

from __future__ import annotations

import io

import numpy as np

from zephon._args import positive_int
from zephon.operators._decode import Decode


def frame_choice(total: int, num_frames: int) -> list[int]:
    """``num_frames`` frame numbers spread evenly over ``total`` frames, first and last
    included (repeated when the clip is shorter)."""
    if total <= 0:
        raise ValueError("the clip has no video frames")
    if num_frames == 1:
        return [0]
    return [round(i * (total - 1) / (num_frames - 1)) for i in range(num_frames)]


class DecodeVideo(Decode):
    name = "decode_video"
    what = "a video"
    module = "av"
    package = "av (PyAV)"

    def __init__(
        self,
        field: str,
        to: str | None = None,
        num_frames: int = 8,
        on_error: str = "raise",
        parallelism: int = 1,
        on_missing: str = "error",
    ) -> None:
        super().__init__(field, to, on_error, parallelism, on_missing)
        self.num_frames = positive_int("decode_video(num_frames=...)", num_frames)

    def decode(self, raw: bytes) -> np.ndarray:
        av = self.lib
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            # Frames are counted by decoding (a container's frame count may be absent or
            # wrong); only the chosen ones are converted to RGB.
            frames = list(container.decode(stream))
            chosen = frame_choice(len(frames), self.num_frames)
            rgb = {i: frames[i].to_ndarray(format="rgb24") for i in sorted(set(chosen))}
        return np.stack([rgb[i] for i in chosen])

    def _params(self) -> str:
        return f"{super()._params()}, num_frames={self.num_frames}"

"""``decode_audio``: an audio member to mono float32 samples at ``sample_rate`` (PyAV)."""

from __future__ import annotations

import io

import numpy as np

from zephon._args import positive_int
from zephon.operators._decode import Decode


class DecodeAudio(Decode):
    name = "decode_audio"
    what = "audio"
    module = "av"
    package = "av (PyAV)"

    def __init__(
        self,
        field: str,
        to: str | None = None,
        sample_rate: int = 16000,
        on_error: str = "raise",
        parallelism: int = 1,
        on_missing: str = "error",
    ) -> None:
        super().__init__(field, to, on_error, parallelism, on_missing)
        self.sample_rate = positive_int("decode_audio(sample_rate=...)", sample_rate, "Hz")

    def decode(self, raw: bytes) -> np.ndarray:
        av = self.lib
        resampler = av.AudioResampler(format="flt", layout="mono", rate=self.sample_rate)
        parts: list[np.ndarray] = []
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.audio:
                raise ValueError("no audio stream")
            for frame in container.decode(container.streams.audio[0]):
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                parts.append(out.to_ndarray().reshape(-1))
        if not parts:
            return np.zeros(0, np.float32)
        return np.concatenate(parts).astype(np.float32, copy=False)

    def _params(self) -> str:
        return f"{super()._params()}, sample_rate={self.sample_rate}"

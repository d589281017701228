"""``decode_image``: JPEG, PNG or WebP bytes to a uint8 ``(H, W, C)`` array (Pillow)."""

from __future__ import annotations

import io

import numpy as np

from zephon.operators._decode import Decode

_CHANNELS = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4, "CMYK": 4, "YCbCr": 3, "P": 1}


class DecodeImage(Decode):
    name = "decode_image"
    what = "an image"
    module = "PIL.Image"
    package = "Pillow"

    def __init__(
        self,
        field: str,
        to: str | None = None,
        mode: str | None = "RGB",
        draft: tuple[int, int] | None = None,
        on_error: str = "raise",
        parallelism: int = 1,
        on_missing: str = "error",
    ) -> None:
        super().__init__(field, to, on_error, parallelism, on_missing)
        if mode is not None and mode not in _CHANNELS:
            raise ValueError(
                f"decode_image(mode=...) must be one of {sorted(_CHANNELS)} or None; got {mode!r}"
            )
        if draft is not None:
            if (
                not isinstance(draft, tuple | list)
                or len(draft) != 2
                or not all(isinstance(v, int) and v > 0 for v in draft)
            ):
                raise ValueError(
                    f"decode_image(draft=...) must be (width, height) in pixels; got {draft!r}"
                )
            draft = (int(draft[0]), int(draft[1]))
        self.mode = mode
        self.draft = draft

    def decode(self, raw: bytes) -> np.ndarray:
        image_module = self.lib
        with image_module.open(io.BytesIO(raw)) as img:
            if self.draft is not None and img.format == "JPEG":
                # DCT scaling: decodes at 1/2, 1/4 or 1/8 size, never below ``draft``.
                img.draft(self.mode or img.mode, self.draft)
            img.load()
            if self.mode is not None and img.mode != self.mode:
                img = img.convert(self.mode)
            array = np.asarray(img)
        if array.ndim == 2:
            array = array[:, :, None]
        return np.ascontiguousarray(array)

    def _params(self) -> str:
        return f"{super()._params()}, mode={self.mode!r}, draft={self.draft!r}"

"""Tar shards of real media through decoding, per-sample random crops, workers and resume.

The shards are written here: JPEG, PNG and WebP images made with Pillow, a short video and
an audio clip made with PyAV. Under ``CI=true`` a missing Pillow or PyAV fails these tests
(the conftest turns skips into failures).
"""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zephon as zp
from zephon.testing import assert_resumes_exactly, assert_same_batches, global_batches, take

Image = pytest.importorskip("PIL.Image", reason="pip install zephon[media]")
av = pytest.importorskip("av", reason="pip install zephon[media]")

pytestmark = pytest.mark.processes

N_SHARDS, PER_SHARD = 2, 20
CROP = 24


def picture(i: int, size: tuple[int, int] | None = None) -> np.ndarray:
    """An RGB image of its own size and content: smooth, so JPEG keeps it close."""
    w, h = size or (32 + i % 9, 28 + i % 7)
    y, x = np.mgrid[0:h, 0:w]
    return np.stack(
        [(x * 5 + i * 7) % 256, (y * 5 + i * 3) % 256, np.full_like(x, i * 11 % 256)], -1
    ).astype(np.uint8)


def encode(array: np.ndarray, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **options)
    return out.getvalue()


def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def jpeg_shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("shards")
    paths = []
    for s in range(N_SHARDS):
        samples = [
            (f"{i:05d}", {"jpg": encode(picture(i), "JPEG", quality=90), "cls": b"%d" % (i % 3)})
            for i in range(s * PER_SHARD, (s + 1) * PER_SHARD)
        ]
        paths.append(write_shard(folder / f"train-{s:04d}.tar", samples))
    return paths


def random_resized_crop(data: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """A random crop of half to all of each side, resized to CROP x CROP (nearest), and a
    random horizontal flip: its randomness comes from random_map's per-sample rng."""
    image = data["image"]
    h, w = image.shape[:2]
    ch, cw = int(rng.integers(h // 2, h + 1)), int(rng.integers(w // 2, w + 1))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    rows = y + np.arange(CROP) * ch // CROP
    cols = x + np.arange(CROP) * cw // CROP
    out = image[rows][:, cols]
    if rng.random() < 0.5:
        out = out[:, ::-1]
    return {"image": np.ascontiguousarray(out), "index": np.int64(int(data["__key__"]))}


def build(
    shards: list[Path], workers: int, num_epochs: int | None = 1, **options: Any
) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource(
        [zp.TarShardSource([str(p) for p in shards], members=("jpg",))],
        seed=5,
        chunk_size=4,
        num_epochs=num_epochs,
    )
    pipe = zp.Pipeline(
        src,
        canonical_replicas=4,
        workers=workers,
        worker_start_method="forkserver",
        worker_timeout_s=60,
        seed=11,
        **options,
    )
    return (
        pipe.fetch()
        .decode_image("jpg", to="image")
        .random_map(random_resized_crop)
        .batch(4, drop_last=False)
    )


def test_images_decode_in_each_format() -> None:
    original = picture(3)
    record = {
        "__key__": "k",
        "png": encode(original, "PNG"),
        "webp": encode(original, "WEBP", lossless=True),
        "jpg": encode(original, "JPEG", quality=95),
    }
    pipe = zp.Pipeline(
        zp.StaticMixtureWorkSource([[record]], seed=0, num_epochs=1), canonical_replicas=1
    )
    pipe = (
        pipe.fetch()
        .decode_image("png")
        .decode_image("webp", to="webp_array")
        .decode_image("jpg", mode="L")
    )
    (out,) = take(
        pipe.map(lambda d: {"png": d["png"], "webp": d["webp_array"], "jpg": d["jpg"]}).batch(1)
    )
    np.testing.assert_array_equal(out["png"][0], original)
    np.testing.assert_array_equal(out["webp"][0], original)
    assert out["png"].dtype == np.uint8 and out["png"].shape == (1, *original.shape)
    assert out["jpg"].shape == (1, *original.shape[:2], 1)  # mode "L": one channel, HWC
    gray = np.asarray(Image.fromarray(original).convert("L"), dtype=np.float64)
    assert np.abs(out["jpg"][0, :, :, 0] - gray).mean() < 4  # JPEG: close, not equal


def test_draft_downscales_jpeg() -> None:
    from zephon.operators import DecodeImage

    big = encode(picture(1, size=(256, 192)), "JPEG")
    assert DecodeImage("jpg").decode(big).shape == (192, 256, 3)
    assert DecodeImage("jpg", draft=(64, 48)).decode(big).shape == (48, 64, 3)
    assert DecodeImage("jpg", draft=(100, 90)).decode(big).shape == (96, 128, 3)  # >= asked
    assert DecodeImage("jpg", draft=(100, 100)).decode(big).shape == (192, 256, 3)
    png = encode(picture(1, size=(256, 192)), "PNG")
    assert DecodeImage("png", draft=(64, 48)).decode(png).shape == (192, 256, 3)  # JPEG only


def test_every_sample_once_per_epoch_with_two_workers(jpeg_shards: list[Path]) -> None:
    with build(jpeg_shards, workers=2) as pipe:
        batches = take(pipe)
    seen = np.concatenate([b["index"] for b in batches])
    assert sorted(seen.tolist()) == list(range(N_SHARDS * PER_SHARD))
    assert all(
        b["image"].shape[1:] == (CROP, CROP, 3) and b["image"].dtype == np.uint8 for b in batches
    )


def test_resumes_exactly_through_decode_and_random_crop(jpeg_shards: list[Path]) -> None:
    """The same batches with 0 and 2 workers, and a checkpoint of a 2-worker run restores
    into 1 worker exactly: decoding is deterministic and each crop depends only on the
    sample's identity."""
    with build(jpeg_shards, workers=0, num_epochs=None) as pipe:
        reference = take(pipe, 14)
    assert_resumes_exactly(
        lambda: build(jpeg_shards, workers=2, num_epochs=None),
        restore_build=lambda: build(jpeg_shards, workers=1, num_epochs=None),
        reference=reference,
        cuts=[0, 1, 4, 7, 10, 13],
    )


def corrupt_shard(folder: Path) -> Path:
    good = encode(picture(0), "JPEG")
    return write_shard(
        folder / "bad.tar",
        [
            ("a", {"jpg": good}),
            ("b", {"jpg": good[: len(good) // 2]}),  # truncated JPEG
            ("c", {"jpg": b"not an image at all"}),
            ("d", {"png": encode(picture(1), "PNG")}),  # no jpg member
            ("e", {"jpg": good}),
        ],
    )


def bad_pipeline(path: Path, on_error: str) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource([zp.TarShardSource(path)], seed=0, shuffle=False, num_epochs=1)
    pipe = zp.Pipeline(src, canonical_replicas=1).fetch().decode_image("jpg", on_error=on_error)
    return pipe.map(lambda d: {"key": d["__key__"], "shape": np.array(d["jpg"].shape)}).batch(1)


def test_corrupt_jpeg_errors_name_shard_key_and_member(tmp_path: Path) -> None:
    path = corrupt_shard(tmp_path)
    pipe = bad_pipeline(path, "raise")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"decode_image: cannot decode field 'jpg' of sample 'b' (member 'b.jpg' of {path})"
        )
        + r" as an image \(OSError: .*\); fix or drop the member, or pass on_error='skip'",
    ):
        take(pipe)


def test_corrupt_members_are_skipped(tmp_path: Path) -> None:
    path = corrupt_shard(tmp_path)
    with bad_pipeline(path, "skip") as pipe:
        batches = take(pipe)
        ops = {op["name"]: op for op in pipe.stats()["operators"]}
    assert [str(b["key"][0]) for b in batches] == ["a", "e"]
    # What decode_image dropped: its records in minus records out.
    assert (ops["decode_image"]["records_in"], ops["decode_image"]["records_out"]) == (5, 2)


def test_missing_member_error_names_the_sample(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "a.tar", [("x", {"png": encode(picture(1), "PNG")})])
    src = zp.StaticMixtureWorkSource([zp.TarShardSource(path)], seed=0, num_epochs=1)
    pipe = zp.Pipeline(src, canonical_replicas=1).fetch().decode_image("jpg").batch(1)
    with pytest.raises(
        KeyError, match=re.escape(f"decode_image: sample 'x' (member 'x.jpg' of {path})")
    ):
        take(pipe)


def short_video(frames: int = 12) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(
                np.full((24, 32, 3), i * 20, np.uint8), format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def short_audio(seconds: float = 0.5, rate: int = 8000) -> bytes:
    out = io.BytesIO()
    n = int(seconds * rate)
    with av.open(out, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=rate, layout="mono")
        wave = (np.sin(np.arange(n) * 2 * np.pi * 440 / rate) * 8000).astype(np.int16)[None]
        frame = av.AudioFrame.from_ndarray(wave, format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def test_video_and_audio(tmp_path: Path) -> None:
    path = write_shard(
        tmp_path / "av.tar",
        [(f"clip{i}", {"mp4": short_video(12 + i), "wav": short_audio()}) for i in range(2)],
    )
    src = zp.StaticMixtureWorkSource([zp.TarShardSource(path)], seed=0, shuffle=False, num_epochs=1)
    pipe = zp.Pipeline(src, canonical_replicas=1).fetch()
    pipe = pipe.decode_video("mp4", to="video", num_frames=8).decode_audio(
        "wav", to="audio", sample_rate=16000
    )
    pipe = pipe.map(lambda d: {"video": d["video"], "audio": d["audio"]}).batch(2)
    (batch,) = take(pipe)
    assert batch["video"].shape == (2, 8, 24, 32, 3) and batch["video"].dtype == np.uint8
    # 12 frames of values 0, 20, ..., 220: frames 0, 2, 3, 5, 6, 8, 9, 11 chosen evenly.
    np.testing.assert_allclose(
        batch["video"][0, :, 12, 16, 0], [0, 40, 60, 100, 120, 160, 180, 220], atol=6
    )
    assert batch["audio"].shape == (2, 8000) and batch["audio"].dtype == np.float32
    assert 0.2 < np.abs(batch["audio"]).max() < 0.3  # 8000 / 32768, resampled


def test_import_zephon_imports_no_media_library() -> None:
    import subprocess
    import sys

    code = "import sys, zephon; assert not {'PIL', 'av'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_media_library_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from zephon.operators import DecodeImage, DecodeVideo

    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(
        ImportError,
        match=re.escape("decode_image needs Pillow; install it with `pip install zephon[media]`"),
    ):
        DecodeImage("jpg").decode(b"")
    with pytest.raises(ImportError, match=re.escape("decode_video needs av (PyAV); install it")):
        DecodeVideo("mp4").decode(b"")


# ---- Media packing: captions with images, packed beside their tokens -------------------------

#: The image placeholder token (one past the byte tokenizer's ids) and how many stand for
#: one image in a caption's tokens.
IMAGE_ID = zp.ByteTokenizer.vocab_size
PATCHES = 4
MAX_IMAGES = 2
SEQ = 64


class PlaceholderTokenizer:
    """Bytes, with each ``<image>`` in the text becoming ``PATCHES`` ``IMAGE_ID`` tokens."""

    def __init__(self) -> None:
        self.bytes = zp.ByteTokenizer(add_eos=False)

    def encode(self, text: str) -> np.ndarray:
        parts = text.split("<image>")
        out = [self.bytes.encode(parts[0])]
        for part in parts[1:]:
            out += [np.full(PATCHES, IMAGE_ID, np.int32), self.bytes.encode(part)]
        return np.concatenate(out)

    def __repr__(self) -> str:  # what the fingerprint reads
        return f"PlaceholderTokenizer(image_id={IMAGE_ID}, patches={PATCHES})"


def caption_and_crop(data: Any, rng: np.random.Generator) -> dict[str, Any]:
    """A decoded image sample: randomly cropped (as ``random_resized_crop``), its caption
    led by an ``<image>`` placeholder; a text document (a str) as it is."""
    if isinstance(data, str):
        return {"text": data}
    crop = random_resized_crop(data, rng)
    return {"image": crop["image"], "text": f"<image>photo {data['__key__']}"}


def text_corpus(folder: Path) -> Path:
    path = folder / "text.jsonl"
    lines = [f'{{"text": "plain text document {i} {"words " * (i % 7)}"}}' for i in range(30)]
    path.write_text("\n".join(lines) + "\n")
    return path


def build_packed(
    shards: list[Path],
    workers: int,
    text: Path | None = None,
    num_epochs: int | None = None,
    **pipeline: Any,
) -> zp.Pipeline:
    """Shards -> decode -> random crop -> tokens with placeholders -> split -> pack with
    media -> batch; with ``text``, a mixture of the image shards and that text corpus."""
    datasets: list[Any] = [zp.TarShardSource([str(p) for p in shards], members=("jpg",))]
    if text is not None:
        datasets.append(zp.JsonlSource(text, field="text"))
    src = zp.StaticMixtureWorkSource(
        datasets, seed=5, chunk_size=4, num_epochs=num_epochs, weights=None
    )
    pipe = zp.Pipeline(
        src,
        canonical_replicas=2,
        workers=workers,
        worker_start_method="forkserver",
        worker_timeout_s=60,
        seed=11,
        flush_every_k_chunks=3,
        **pipeline,
    ).fetch()
    # The text corpus's samples have no image: on_missing="pass" lets them through.
    missing = "error" if text is None else "pass"
    pipe = pipe.decode_image("jpg", to="image", on_missing=missing)
    pipe = pipe.random_map(caption_and_crop).tokenize(PlaceholderTokenizer())
    pipe = pipe.split(max_len=32).pack(
        SEQ, num_bins=3, media={"image": (CROP, CROP, 3)}, max_media=MAX_IMAGES
    )
    return pipe.batch(2, drop_last=False)


def check_rows(batches: list[dict[str, np.ndarray]]) -> int:
    """Every item sits in a row whose segment of that id holds exactly one image's
    placeholders, and every unused slot is zero: the number of items."""
    items = 0
    for b in batches:
        assert b["image"].shape[1:] == (MAX_IMAGES, CROP, CROP, 3)
        assert b["image_mask"].dtype == np.bool_ and b["image_segment_ids"].dtype == np.int32
        for r in range(len(b["tokens"])):
            mask, segs = b["image_mask"][r], b["image_segment_ids"][r]
            assert not b["image"][r][~mask].any() and not segs[~mask].any()
            for seg in segs[mask]:
                tokens = b["tokens"][r][b["tokens_segment_ids"][r] == seg]
                assert (tokens == IMAGE_ID).sum() == PATCHES
            items += int(mask.sum())
    return items


def test_packed_images_each_once_per_epoch_beside_their_placeholders_and_resume(
    jpeg_shards: list[Path],
) -> None:
    """Through decode_image, a random crop, placeholders and pack with media: every image
    once in an epoch, and a checkpoint of a 2-worker run restores into 1 worker exactly."""
    reference = assert_resumes_exactly(
        lambda: build_packed(jpeg_shards, workers=2, num_epochs=1),
        restore_build=lambda: build_packed(jpeg_shards, workers=1, num_epochs=1),
        cuts=[0, 4, 100],
    )
    assert check_rows(reference) == N_SHARDS * PER_SHARD


def test_packed_media_in_a_mixture_with_text_resumes_exactly(
    jpeg_shards: list[Path], tmp_path: Path
) -> None:
    """Decode, random crop, placeholders, pack with media, a mixture with a text corpus and
    batch: a checkpoint of a 2-worker run restores into 1 worker exactly."""
    text = text_corpus(tmp_path)
    with build_packed(jpeg_shards, workers=0, text=text) as pipe:
        reference = take(pipe, 12)
    check_rows(reference)
    assert any(b["image_mask"].all(axis=1).any() for b in reference)  # rows with 2 images
    assert any((~b["image_mask"]).all(axis=1).any() for b in reference)  # and text-only
    assert_resumes_exactly(
        lambda: build_packed(jpeg_shards, workers=2, text=text),
        restore_build=lambda: build_packed(jpeg_shards, workers=1, text=text),
        reference=reference,
        cuts=[0, 3, 7, 12],
    )


def test_packed_media_global_batches_continue_exactly_in_another_rank_count(
    jpeg_shards: list[Path], tmp_path: Path
) -> None:
    """Lockstep global batches of the mixture, ranks simulated in one process: 2 ranks for 3
    steps, their states merged, then 1 rank: the batches of 1 rank all along."""
    text = text_corpus(tmp_path)

    def build(rank: int, world_size: int) -> zp.Pipeline:
        return build_packed(
            jpeg_shards, 0, text, rank=rank, world_size=world_size, output="lockstep"
        )

    reference, _ = global_batches(build, 1, 7)
    check_rows(reference)
    head, merged = global_batches(build, 2, 3)
    tail, _ = global_batches(build, 1, 4, merged)
    assert_same_batches(reference, head + tail)


def test_on_missing_pass_lets_other_samples_through_and_error_names_the_way(
    jpeg_shards: list[Path], tmp_path: Path
) -> None:
    """A mixture of images and text: decode_image's default refuses a text sample, naming
    on_missing='pass'; with it, the text samples pass as they came."""
    text = text_corpus(tmp_path)

    def build(on_missing: str) -> zp.Pipeline:
        src = zp.StaticMixtureWorkSource(
            [zp.TarShardSource([str(p) for p in jpeg_shards]), zp.JsonlSource(text, field="text")],
            seed=0,
            num_epochs=1,
        )
        return (
            zp.Pipeline(src, canonical_replicas=1)
            .fetch()
            .decode_image("jpg", to="image", on_missing=on_missing)
        )

    with pytest.raises(KeyError, match="on_missing='pass' to let them through undecoded"):
        with build("error") as pipe:
            take(pipe, 200)
    with build("pass") as pipe:
        samples = take(pipe, 200)
    texts = [s for s in samples if isinstance(s, str)]
    images = [s for s in samples if isinstance(s, dict)]
    assert len(texts) == 30 and len(images) == N_SHARDS * PER_SHARD
    assert all(s["image"].dtype == np.uint8 and s["image"].ndim == 3 for s in images)
    with pytest.raises(ValueError, match=r"on_missing=\.\.\.\) must be one of"):
        build("keep")


def _shared_ranges() -> list[tuple[int, int]]:
    """This process's mappings of Zephon's shared-memory segments (the rings)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "zephon-ring" in fields[5]:  # /memfd:zephon-ring-<k>
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                out.append((lo, hi))
    return out


@pytest.mark.parametrize("zero_copy", [True, False])
def test_decoded_batches_reach_the_consumer_from_the_ring_without_a_copy(
    jpeg_shards: list[Path], zero_copy: bool
) -> None:
    """Batches of decoded, cropped images are stacked by the worker into its ring slot; with
    zero_copy=True the consumer's arrays are that slot's memory (no copy in the parent),
    else one copy each, outside the ring. The same pixels either way."""

    def run(zero_copy: bool) -> list[dict[str, np.ndarray]]:
        pipe = build(jpeg_shards, workers=2, zero_copy=zero_copy)
        got = []
        with pipe:
            for batch in pipe:
                image = batch["image"]
                inside = any(lo <= image.ctypes.data < hi for lo, hi in _shared_ranges())
                assert inside is zero_copy and image.flags.owndata is not zero_copy
                got.append({k: v.copy() for k, v in batch.items()})
        return got

    with build(jpeg_shards, workers=0) as pipe:
        reference = take(pipe)
    assert_same_batches(reference, run(zero_copy))

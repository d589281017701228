"""Image captions to packed rows with media, and one training step of a tiny VLM in JAX.

Caption pairs in tar shards (``00012.jpg`` + ``00012.txt``, the WebDataset layout) ->
``decode_image`` -> a random crop and flip per sample (``random_map``) -> tokens with
``PATCHES`` image placeholder tokens in front of each caption -> rows of ``SEQ_LEN``
tokens packed with their images (``pack(media=..., max_media=...)``) -> batches of
``tokens`` ``[B, SEQ_LEN]``, ``image`` ``[B, MAX_IMAGES, IMG, IMG, 3]``, ``image_mask`` and
``image_segment_ids`` ``[B, MAX_IMAGES]`` -> a ViT patch embedding whose outputs replace
the placeholder tokens' embeddings, in order, and a one-layer decoder that attends within
each segment:

    python examples/vlm_captions.py --steps 20 --save-at 10

writes the shards to a temporary folder, trains 20 steps, saves the loader's state at step
10, builds the pipeline again, restores it and checks that steps 10..19 get the same
batches bit for bit. The images are made with Pillow here; point ``build`` at your own
shards (local paths or s3:// URLs) instead.

The row layout is what LLaVA-style code merges: the ``j``-th placeholder token of a row
belongs to the row's image ``j // PATCHES`` (images sit in the row in the order of their
documents, as their placeholders do), and ``image_segment_ids`` names the document of each
image, so the merge can be checked, and attention kept within a document, per row.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import zephon as zp

IMG = 16  # the crop's side in pixels
PATCH = 8  # the ViT's patch side: (IMG // PATCH) ** 2 patches an image
PATCHES = (IMG // PATCH) ** 2  # placeholder tokens an image
IMAGE_ID = zp.ByteTokenizer.vocab_size  # the placeholder's token id (one past the bytes)
VOCAB = IMAGE_ID + 1
SEQ_LEN = 96
MAX_IMAGES = 3
BATCH = 4
LR = 0.3  # plain SGD
WORDS = ["a", "red", "blue", "square", "stripe", "on", "the", "left", "right", "sky", "dot"]


def write_shards(folder: Path, shards: int = 2, per_shard: int = 24, seed: int = 0) -> list[Path]:
    """Tar shards of JPEG images (of varied sizes) with their captions."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for s in range(shards):
        path = folder / f"captions-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(s * per_shard, (s + 1) * per_shard):
                h, w = int(rng.integers(20, 40)), int(rng.integers(20, 40))
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                jpg = io.BytesIO()
                Image.fromarray(pixels).save(jpg, format="JPEG", quality=85)
                caption = " ".join(rng.choice(WORDS, int(rng.integers(3, 12))))
                for ext, data in (("jpg", jpg.getvalue()), ("txt", caption.encode())):
                    info = tarfile.TarInfo(f"{i:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


class CaptionTokenizer:
    """Bytes, each ``<image>`` in the text becoming ``PATCHES`` ``IMAGE_ID`` tokens, and an
    EOS at the end (use your tokenizer's own image token the same way)."""

    def __init__(self) -> None:
        self.bytes = zp.ByteTokenizer(add_eos=True)

    def encode(self, text: str) -> np.ndarray:
        head, *rest = text.split("<image>")
        out = [self.bytes.encode(head)[:-1]]  # (the EOS goes at the end only)
        for part in rest:
            out += [np.full(PATCHES, IMAGE_ID, np.int32), self.bytes.encode(part)[:-1]]
        return np.concatenate([*out, np.array([1], np.int32)])

    def __repr__(self) -> str:  # what the pipeline's fingerprint reads
        return f"CaptionTokenizer(image_id={IMAGE_ID}, patches={PATCHES})"


def crop_and_caption(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """A random crop of 60-100% of each side resized to IMG x IMG (nearest), a random
    horizontal flip, and the caption led by its image's placeholder. ``rng`` comes from
    the sample's identity: the same crop with any worker count and after a restore."""
    image = sample["image"]
    h, w = image.shape[:2]
    ch, cw = int(rng.integers(h * 3 // 5, h + 1)), int(rng.integers(w * 3 // 5, w + 1))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    out = image[y + np.arange(IMG) * ch // IMG][:, x + np.arange(IMG) * cw // IMG]
    if rng.random() < 0.5:
        out = out[:, ::-1]
    caption = bytes(sample["txt"]).decode()
    return {"image": np.ascontiguousarray(out), "text": "<image>" + caption}


def build(shards: list[Path], num_epochs: int | None = None) -> zp.Pipeline:
    """The pipeline (in this process: ``workers=N`` needs its functions importable by
    the workers, so put them in a module of your package rather than a script)."""
    src = zp.StaticMixtureWorkSource(
        [zp.TarShardSource([str(p) for p in shards], members=("jpg", "txt"))],
        seed=0,
        chunk_size=8,
        num_epochs=num_epochs,
    )
    return (
        zp.Pipeline(src, canonical_replicas=2, seed=1)
        .fetch()
        .decode_image("jpg", to="image")
        .random_map(crop_and_caption)
        .tokenize(CaptionTokenizer())
        .split(max_len=SEQ_LEN)  # (a caption longer than a row: its image goes with piece 0)
        .pack(SEQ_LEN, num_bins=4, media={"image": (IMG, IMG, 3)}, max_media=MAX_IMAGES)
        .batch(BATCH)
    )


def check_layout(batch: dict[str, np.ndarray]) -> None:
    """Each row's images and placeholder runs agree: image ``k``'s ``PATCHES`` placeholders
    are the row's ``k``-th run, in the segment ``image_segment_ids`` names."""
    for r in range(len(batch["tokens"])):
        where = np.flatnonzero(batch["tokens"][r] == IMAGE_ID)
        count = int(batch["image_mask"][r].sum())
        assert len(where) == count * PATCHES, (len(where), count)
        segs = batch["tokens_segment_ids"][r][where].reshape(count, PATCHES)
        assert (segs == batch["image_segment_ids"][r][:count, None]).all()


def init_params(key: Any) -> dict[str, Any]:
    import jax

    d = 32
    k = jax.random.split(key, 6)
    scale = 0.1
    return {
        "patch": jax.random.normal(k[0], (PATCH * PATCH * 3, d)) * scale,
        "embed": jax.random.normal(k[1], (VOCAB, d)) * scale,
        "pos": jax.random.normal(k[2], (SEQ_LEN, d)) * scale,
        "qkv": jax.random.normal(k[3], (d, 3 * d)) * scale,
        "mlp": jax.random.normal(k[4], (d, d)) * scale,
        "out": jax.random.normal(k[5], (d, VOCAB)) * scale,
    }


def loss_fn(params: dict[str, Any], batch: dict[str, Any]) -> Any:
    """Next-token loss on caption tokens of a row whose placeholders hold patch embeddings."""
    import jax
    import jax.numpy as jnp

    tokens, seg, pos = batch["tokens"], batch["tokens_segment_ids"], batch["tokens_positions"]
    b, m = batch["image"].shape[:2]
    # ViT patch embedding: [B, M, IMG, IMG, 3] -> [B, M * PATCHES, D], in the row's order.
    images = batch["image"].astype(jnp.float32) / 255.0
    n = IMG // PATCH
    patches = images.reshape(b, m, n, PATCH, n, PATCH, 3).transpose(0, 1, 2, 4, 3, 5, 6)
    vis = patches.reshape(b, m * PATCHES, PATCH * PATCH * 3) @ params["patch"]
    # The j-th placeholder of a row takes visual embedding j (LLaVA's merge).
    is_img = tokens == IMAGE_ID
    slot = jnp.clip(jnp.cumsum(is_img, axis=1) - 1, 0, m * PATCHES - 1)
    picked = jnp.take_along_axis(vis, slot[..., None], axis=1)
    x = jnp.where(is_img[..., None], picked, params["embed"][tokens]) + params["pos"][pos]
    # One attention layer, causal within each segment (padding attends to nothing).
    q, k, v = jnp.split(x @ params["qkv"], 3, axis=-1)
    causal = jnp.tril(jnp.ones((SEQ_LEN, SEQ_LEN), bool))
    allowed = causal & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    att = jnp.where(allowed, q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]), -1e9)
    x = x + jax.nn.softmax(att, axis=-1) @ v
    x = x + jax.nn.gelu(x @ params["mlp"])
    logits = x @ params["out"]
    # Targets: the next token of the same segment, never a placeholder.
    target = tokens[:, 1:]
    keep = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0) & (target != IMAGE_ID)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return (nll * keep).sum() / jnp.maximum(keep.sum(), 1)


def digest(batch: dict[str, np.ndarray]) -> bytes:
    return b"".join(np.asarray(batch[k]).tobytes() for k in sorted(batch))


def run(folder: Path, steps: int, save_at: int) -> bool:
    import jax

    shards = write_shards(folder)
    params = init_params(jax.random.PRNGKey(0))
    step = jax.jit(
        lambda p, b: jax.tree_util.tree_map(lambda w, g: w - LR * g, p, jax.grad(loss_fn)(p, b))
    )
    loss = jax.jit(loss_fn)
    seen = []
    with build(shards) as pipe:
        for i, batch in enumerate(pipe):
            if i == 0:
                print("a batch:")
                for k, v in sorted(batch.items()):
                    print(f"  {k:20s} {v.dtype.name:6s} {tuple(v.shape)}")
            check_layout(batch)
            if i % 5 == 0:
                print(f"step {i:3d}  loss {float(loss(params, batch)):.3f}")
            params = step(params, batch)
            seen.append(digest(batch))
            if i + 1 == save_at:
                state = pipe.checkpoint()
            if i + 1 == steps:
                break
    with build(shards) as pipe:
        pipe.restore(state)
        again = [digest(b) for b, _ in zip(pipe, range(steps - save_at), strict=False)]
    same = again == seen[save_at:]
    print(
        f"restored after step {save_at}: steps {save_at}..{steps - 1} "
        + ("identical bit for bit" if same else "DIFFER")
    )
    return same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-at", type=int, default=10)
    args = ap.parse_args(argv)
    if not 0 < args.save_at < args.steps:
        ap.error(f"--save-at must be in (0, --steps={args.steps}); got {args.save_at}")
    with tempfile.TemporaryDirectory() as folder:
        return 0 if run(Path(folder), args.steps, args.save_at) else 1


if __name__ == "__main__":
    sys.exit(main())

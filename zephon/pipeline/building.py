"""The builder half of :class:`~zephon.Pipeline`: the methods that append an operator.

``fetch``, ``tokenize``, ``split``, ``pack``, ``batch`` and the rest each check their
arguments, build one operator and return a new pipeline whose chain ends with it; the
pipeline they were called on is left as it was. Their docstrings are the operators' user
documentation (the operator classes in :mod:`zephon.operators` keep theirs short).

:class:`ChainBuilder` knows only the chain (``_ops``). Running it (compiling, iterating,
checkpointing) is :mod:`zephon.pipeline.pipeline`'s: ``Pipeline`` inherits these methods
and, through :meth:`ChainBuilder._extended`, clears on each new pipeline what it derived
from the old chain. Nothing here imports :mod:`zephon.pipeline.pipeline`; the methods
return ``Self``, which is ``Pipeline`` for a ``Pipeline``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import numpy as np

from zephon.operators.base import Operator
from zephon.operators.batch import Batch
from zephon.operators.decode_audio import DecodeAudio
from zephon.operators.decode_image import DecodeImage
from zephon.operators.decode_video import DecodeVideo
from zephon.operators.ensure_mixture import EnsureMixture
from zephon.operators.fetch import Fetch
from zephon.operators.filter import Filter
from zephon.operators.lm import LmTargets, TrimOrPad
from zephon.operators.map import Map
from zephon.operators.pack.pack import Pack
from zephon.operators.random_map import RandomMap
from zephon.operators.shuffle import Shuffle
from zephon.operators.split import Split
from zephon.operators.tokenize import Tokenize

__all__ = ["ChainBuilder"]


class ChainBuilder:
    """An operator chain and the builder methods that extend it (``Pipeline``'s base).

    The one piece of state these methods read and write is :attr:`_ops`. Each returns a
    shallow copy made by :meth:`_extended`, so a subclass that keeps state derived from the
    chain (``Pipeline``: the compiled plan, fingerprint, engine, aggregator) overrides that
    one method to clear it.
    """

    #: The operators in order. Never changed in place: pipelines built from one another
    #: share their operators, and a builder method gives the new pipeline a new tuple.
    _ops: tuple[Operator, ...]

    def __init__(self) -> None:
        self._ops = ()

    def _extended(self, ops: tuple[Operator, ...]) -> Self:
        """A shallow copy of this pipeline whose chain is ``ops``; a subclass clears here,
        on the copy, whatever it derived from the old chain or started running."""
        new = copy.copy(self)
        new._ops = ops
        return new

    def apply(self, op: Operator) -> Self:
        """A new pipeline with a custom :class:`~zephon.Operator` appended."""
        if not isinstance(op, Operator):
            raise TypeError(f"apply() takes a zp.Operator; got {type(op).__name__}")
        if type(op) is RandomMap and op.stream is None:
            op = copy.copy(op)
            op.stream = sum(type(o) is RandomMap for o in self._ops)
        return self._extended((*self._ops, op))

    def fetch(self, parallelism: int = 1) -> Self:
        """Resolve sample pointers to raw samples (``ds.read(indices)`` when the dataset has
        it), ``parallelism`` threads per chunk for I/O-bound sources."""
        return self.apply(Fetch(_parallelism(parallelism)))

    def map(self, fn: Callable[[Any], Any], parallelism: int = 1) -> Self:
        """``fn(data) -> new data`` for every record; order is kept with any parallelism."""
        return self.apply(Map(fn, _parallelism(parallelism)))

    def random_map(
        self, fn: Callable[[Any, np.random.Generator], Any], parallelism: int = 1
    ) -> Self:
        """``fn(data, rng) -> new data`` for every record, ``rng`` a
        :class:`numpy.random.Generator` seeded from the pipeline's ``seed`` and the record's
        identity (lane, chunk id, offset, child), never from processing order: a record
        gets the same numbers with any worker count, world size or restore point.

        Example::

            def mask_tokens(data, rng):
                tokens = data["tokens"].copy()
                tokens[rng.random(len(tokens)) < 0.15] = MASK_ID
                return {**data, "tokens": tokens}

            pipe = pipe.tokenize(tok).random_map(mask_tokens)

        Each ``random_map`` of a pipeline draws from its own stream (the first, the second,
        ... by position), so two of them never share numbers."""
        return self.apply(RandomMap(fn, None, _parallelism(parallelism)))

    def decode_image(
        self,
        field: str,
        to: str | None = None,
        mode: str | None = "RGB",
        draft: tuple[int, int] | None = None,
        *,
        on_error: str = "raise",
        on_missing: str = "error",
        parallelism: int = 1,
    ) -> Self:
        """Decode an image member (JPEG, PNG, WebP, anything Pillow reads) of dict samples,
        such as :class:`~zephon.TarShardSource`'s, into a uint8 ``(H, W, C)`` array.

        Runs where the pipeline's operators run: in the worker processes with
        ``workers > 0``. Needs Pillow (``pip install zephon[media]``), imported on the
        first image, not by ``import zephon``.

        Example::

            pipe = (
                zp.Pipeline(zp.StaticMixtureWorkSource([zp.TarShardSource("shards/*.tar")]))
                .fetch()
                .decode_image("jpg", to="image", draft=(256, 256))
                .random_map(random_crop_and_flip)   # per-sample randomness: see random_map
                .map(lambda s: {"image": s["image"]})
                .batch(64)
            )

        Args:
          field: the member (extension) holding the encoded image, e.g. ``"jpg"``.
          to: the field that receives the array (default: ``field``, replacing the bytes).
          mode: the Pillow mode to convert to (``"RGB"``: 3 channels, ``"L"``: 1,
            ``"RGBA"``: 4); None keeps each image's own.
          draft: ``(width, height)``: let JPEG decoding scale down by 1/2, 1/4 or 1/8 as
            long as the image stays at least this large (Pillow's ``Image.draft``; much
            faster for big photos that are cropped to a small size anyway). Other formats
            ignore it.
          on_error: ``"raise"``: a sample without ``field`` or whose bytes do not decode
            raises, naming the key, member and shard; ``"skip"``: it is dropped (a
            tombstone, as ``filter`` drops), and ``stats()`` shows it as this operator's
            records in minus records out.
          on_missing: ``"error"``: a sample without ``field`` is an error (``on_error``
            then raises or skips it); ``"pass"``: it goes on undecoded, as it came (the
            text documents of a mixture with image-caption pairs).
          parallelism: threads decoding slices of a chunk at once (Pillow releases the GIL
            while decoding).
        """
        return self.apply(
            DecodeImage(field, to, mode, draft, on_error, _parallelism(parallelism), on_missing)
        )

    def decode_video(
        self,
        field: str,
        to: str | None = None,
        num_frames: int = 8,
        *,
        on_error: str = "raise",
        on_missing: str = "error",
        parallelism: int = 1,
    ) -> Self:
        """Decode a video member (MP4, WebM, ... through PyAV) into ``num_frames`` uint8 RGB
        frames, a ``(T, H, W, 3)`` array. The frames are chosen evenly over the clip, first
        and last included (repeated when the clip is shorter), so the same bytes always give
        the same frames; draw random clips in a ``random_map`` after it. Needs PyAV
        (``pip install zephon[media]``). ``to``, ``on_error``, ``on_missing`` and
        ``parallelism`` as for :meth:`decode_image`."""
        return self.apply(
            DecodeVideo(field, to, num_frames, on_error, _parallelism(parallelism), on_missing)
        )

    def decode_audio(
        self,
        field: str,
        to: str | None = None,
        sample_rate: int = 16000,
        *,
        on_error: str = "raise",
        on_missing: str = "error",
        parallelism: int = 1,
    ) -> Self:
        """Decode an audio member (WAV, FLAC, MP3, Opus, ... through PyAV) into mono float32
        samples at ``sample_rate`` Hz, a ``(num_samples,)`` array (its length follows the
        clip's: trim or pad it in a ``map`` before ``batch``). Needs PyAV (``pip install
        zephon[media]``). ``to``, ``on_error``, ``on_missing`` and ``parallelism`` as for
        :meth:`decode_image`."""
        return self.apply(
            DecodeAudio(field, to, sample_rate, on_error, _parallelism(parallelism), on_missing)
        )

    def filter(self, pred: Callable[[Any], bool]) -> Self:
        """Keep records whose data satisfies ``pred``; the rest become tombstones."""
        return self.apply(Filter(pred))

    def tokenize(self, tokenizer: Any, field: str | None = None, parallelism: int = 1) -> Self:
        """Returns a pipeline whose samples are tokenized: text (or ``data[field]``, default
        ``"text"``, of a dict sample) becomes ``{"tokens": int32}`` by ``tokenizer.encode``
        (``encode_batch`` when it has one).

        A dict sample keeps its other fields (the text field is replaced by ``tokens``), so
        a document's scalars and per-token arrays reach ``split`` and ``pack``.

        Example usage::

          pipe = zp.Pipeline(src).fetch().tokenize(zp.ByteTokenizer(add_eos=False))
          # a sample {"text": "hi", "loss_weight": 0.5} becomes
          # {"tokens": array([104, 105], dtype=int32), "loss_weight": 0.5}

        Args:
          tokenizer: an object with ``encode(text)`` (``zp.ByteTokenizer``, the Hugging Face
            and sentencepiece adapters).
          field: the text field of dict samples (default ``"text"``).
          parallelism: threads tokenizing slices of a chunk at once.
        """
        return self.apply(Tokenize(tokenizer, field, _parallelism(parallelism)))

    def split(self, max_len: int, feature: str = "tokens") -> Self:
        """Returns a pipeline whose samples are cut into pieces of at most ``max_len``.

        ``feature`` sets the length; every other array of that same length and as many
        dimensions (a per-token feature: targets, a loss mask) is cut at the same places,
        and every other field (an image, whatever its height) is copied to each piece. Piece ``i`` of ``n`` is child ``i`` of the sample, the last
        flagged, so completion tracking knows when a sample is whole.

        Example usage::

          pipe = pipe.split(max_len=4)
          # {"tokens": [1, 2, 3, 4, 5, 6], "mask": [1, 1, 0, 1, 1, 1], "id": 7} becomes
          # {"tokens": [1, 2, 3, 4], "mask": [1, 1, 0, 1], "id": 7} (child 0) and
          # {"tokens": [5, 6], "mask": [1, 1], "id": 7} (child 1, the last)

        Args:
          max_len: the most tokens per piece.
          feature: the feature whose length is cut (default ``"tokens"``).
        """
        return self.apply(Split(max_len, feature))

    def pack(
        self,
        seq_len: int,
        num_bins: int | None = None,
        features: Sequence[str] = ("tokens",),
        *,
        strategy: str = "first_fit",
        max_segments: int | None = None,
        pad_values: Mapping[str, Any] | None = None,
        meta_features: Sequence[str] = (),
        broadcast: Sequence[str] | Mapping[str, Any] = (),
        component_feature: str | None = None,
        bos_id: int | None = None,
        bos_handling: str | None = None,
        order: str = "filled",
        media: Mapping[str, Any] | None = None,
        max_media: int | None = None,
    ) -> Self:
        """Returns a pipeline of rows of ``seq_len`` tokens packed from several pieces.

        Each packed feature ``f`` becomes ``f`` (the pieces concatenated, padded),
        ``f_segment_ids`` (1, 2, ... per piece, 0 on padding) and ``f_positions`` (0, 1, ...
        within each piece), int32 (Grain's names). How pieces are placed:

        * ``"first_fit"`` (default): ``num_bins`` open rows (default 8); a piece goes to the
          lowest row it fits (Grain's ``FirstFitPackIterDataset``);
        * ``"best_fit"``: to the row with the least room that still fits it, the lowest on
          ties (Grain's ``BestFitPackIterDataset``). Either way a row leaves when full
          (``seq_len`` tokens or ``max_segments`` pieces), or, when a piece fits no row, the
          fullest row leaves (lowest on ties) and the piece starts it again.
        * ``"concat_then_split"``: one open row (Grain's ``ConcatThenSplitIterDataset``):
          documents are concatenated and cut at exactly ``seq_len``, so rows are padded only
          at a flush sentinel, at the end of data or by ``max_segments``. No ``split``
          before it: it cuts documents itself, and needs whole samples. As in Grain, a
          document cut across rows continues in the next row as a new segment: segment id
          1 there (the first of that row) and positions restarting at 0.

        Example usage::

          pipe = pipe.tokenize(tok).split(max_len=8).pack(seq_len=8, num_bins=2)
          # pieces [1, 2, 3], [4, 5], [6, 7, 8, 9, 10] give the row
          #   tokens             [1, 2, 3, 4, 5, 0, 0, 0]   (first fit: [1, 2, 3] then [4, 5];
          #   tokens_segment_ids [1, 1, 1, 2, 2, 0, 0, 0]    [6, ..., 10] fits no more there
          #   tokens_positions   [0, 1, 2, 0, 1, 0, 0, 0]    and opens the second row)
          pipe = pipe.tokenize(tok).pack(seq_len=4, strategy="concat_then_split")
          # documents [1, 2, 3], [4, 5, 6] give rows [1, 2, 3, 4] (segment ids [1, 1, 1, 2],
          # positions [0, 1, 2, 0]) and [5, 6, ...] (segment ids [1, 1, ...], positions
          # [0, 1, ...])

        Args:
          seq_len: tokens per row (at most ``2**31 - 1``: positions and segment ids are
            int32).
          num_bins: open rows (first and best fit; default 8; concat-then-split has one).
          features: the per-token features packed with their own segment ids and positions
            (all of one length in a piece).
          strategy: ``"first_fit"``, ``"best_fit"`` or ``"concat_then_split"``.
          max_segments: at most this many segments per row (Grain's
            ``max_sequences_per_bin``, MaxText's ``max_segments_per_seq``); a row that
            reaches it leaves, padded.
          pad_values: pad value per feature, e.g. ``{"targets": -100}`` (default 0); it must
            be exactly representable in the feature's dtype (``ValueError`` otherwise).
            Segment ids and positions always pad with 0.
          meta_features: per-token features packed alongside (concatenated, padded, cut
            along by concat-then-split) without segment ids or positions (Grain's
            ``meta_features``).
          broadcast: scalar fields of each document (kept by ``tokenize``, copied to every
            piece by ``split``) turned into per-token features of the piece's length and
            packed like meta features, e.g. ``broadcast={"loss_weight": "float32"}`` (a list
            of names keeps each number's own dtype).
          component_feature: if given, the name of an int32 feature holding, per token, the
            index of the mixture component it came from (for loss per dataset).
          bos_id: the BOS token id for ``bos_handling``.
          bos_handling: ``"replace_first_token"`` sets the first token of every segment of
            each packed feature (a document's continuation in the next row included) to
            ``bos_id``, dropping the token that was there (Grain's
            ``BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS``); default None adds nothing.
          order: when rows leave. ``"filled"`` (default, as Grain's packers): as soon as a
            row is emptied (full, or the fullest when a piece fits nowhere). ``"arrival"``:
            the same rows, in the order their first pieces arrived; an emptied row waits
            while an older one is still open (until the next flush at most). First fit lets
            short documents wait in open rows while long ones fill rows at once; in arrival
            order each component's token share of every few batches follows what the work
            source dealt (with ``weight_unit="tokens"``: within 0.5 points of the weights over
            windows of 100 batches in ``benchmarks.mixture_fidelity``, against 1.2 filled).
            It costs the waiting rows' memory (their pieces), never padding.
          media: media features carried beside the tokens, each with the shape of one item:
            ``{"image": (224, 224, 3)}`` (uint8) or ``{"audio": ((16000,), "float32")}``. A
            record holds one item (an array of that shape), ``k`` items (``[k, *shape]``) or
            a list of items; a record without the field (a text document) holds none. A row
            gets ``image`` ``[max_media, *shape]`` (its items in piece order, zeros after),
            ``image_mask`` ``[max_media]`` (bool, True on an item) and
            ``image_segment_ids`` ``[max_media]`` (int32: the segment id of the item's
            document in ``tokens_segment_ids``, 0 where unused); ``batch`` stacks them
            (``[B, max_media, *shape]``). A document goes only to a row with room for its
            tokens and its items; with ``split`` before pack its items go with its first
            piece alone. See the multimodal guide.
          max_media: the items of each media feature a row holds (needed with ``media``);
            a document with more is a ``ValueError``.

        Returns:
          A pipeline of dicts of arrays of shape ``(seq_len,)``; a packed record's identity
          is its first piece's.
        """
        if strategy == "concat_then_split":
            splits = [op for op in self._ops if isinstance(op, Split)]
            if splits:
                raise ValueError(
                    f"pack(strategy='concat_then_split') cuts documents itself and needs whole "
                    f"samples; remove {splits[-1]!r} before it"
                )
        return self.apply(
            Pack(
                seq_len,
                num_bins,
                features,
                strategy=strategy,
                max_segments=max_segments,
                pad_values=pad_values,
                meta_features=meta_features,
                broadcast=broadcast,
                component_feature=component_feature,
                bos_id=bos_id,
                bos_handling=bos_handling,
                order=order,
                media=media,
                max_media=max_media,
            )
        )

    def shuffle(self, buffer_size: int, seed: int | None = None) -> Self:
        """Per-lane buffer shuffle, re-seeded every epoch from (seed, lane, epoch start)."""
        return self.apply(Shuffle(buffer_size, seed))

    def ensure_mixture(self, weights: Sequence[float] | None = None, buffer_size: int = 16) -> Self:
        """Reorder records so each component's token share tracks ``weights`` (default:
        the work source's) batch by batch.

        The two mechanisms: the work source decides *what* each epoch holds (with
        ``weight_unit="tokens"`` its token shares are the weights'); ``ensure_mixture`` only
        decides the *order* inside an epoch (a lane's ``flush_every_k_chunks`` chunks), so it
        evens out single batches but never changes the totals. With document weights it
        cannot turn them into token shares (see benchmarks.mixture_fidelity). With a
        :class:`~zephon.Schedule` it needs explicit ``weights``."""
        return self.apply(EnsureMixture(weights, buffer_size))

    def lm_targets(
        self, feature: str = "tokens", ignore_id: int = -100, names: str = "zephon"
    ) -> Self:
        """Next-token layout on packed rows: ``inputs`` (the tokens), ``targets``
        (``targets[i]`` is token ``i + 1`` when it is of the same segment; ``ignore_id`` at
        a segment's last token, on padding and at the row's end), their segment ids and
        positions. A document cut across two rows (``split`` or ``concat_then_split``) has
        no target at its piece's last token: the next token is in another row.

        ``names="zephon"``: ``inputs``, ``targets``, ``inputs_segment_ids``,
        ``inputs_positions``, ``targets_segment_ids``, ``targets_positions``;
        ``names="maxtext"``: ``inputs_segmentation``, ``inputs_position``,
        ``targets_segmentation``, ``targets_position`` (MaxText's model inputs). The
        targets' segment ids are 0 wherever the target is ``ignore_id``: a loss mask.
        Unlike MaxText's ``ShiftData``, which shifts across segment boundaries (a
        segment's last token is trained to predict the next document's first token unless
        that token is an ignored id), no target crosses a document boundary. Other
        features pass through.

        Example::

            pipe = pipe.tokenize(tok).pack(2048, strategy="best_fit").lm_targets(
                ignore_id=0, names="maxtext").batch(8)
            # batch["targets"][r, i] == batch["inputs"][r, i + 1] where
            # batch["targets_segmentation"][r, i] != 0

        Needs ``feature``, ``feature_segment_ids`` and ``feature_positions`` (made by
        ``pack`` or ``trim_or_pad``); may run before or after ``batch``."""
        return self.apply(LmTargets(feature, ignore_id, names))

    def trim_or_pad(
        self, max_len: int, pad_values: Mapping[str, Any] | None = None, feature: str = "tokens"
    ) -> Self:
        """The non-packed path (MaxText's ``PadOrTrimToMaxLength``): every per-token feature
        (a 1-D array as long as ``feature``) cut to ``max_len`` or padded to it with its
        pad value (``pad_values``, default 0), plus ``{feature}_segment_ids`` (1 on real
        tokens, 0 on padding), ``{feature}_positions`` and a boolean ``{feature}_mask``.

        Example::

            pipe = pipe.tokenize(tok).trim_or_pad(512, pad_values={"tokens": PAD_ID})
            # {"tokens": int32[512], "tokens_segment_ids": ..., "tokens_positions": ...,
            #  "tokens_mask": bool[512]}

        Tokens past ``max_len`` are dropped (use ``split`` to keep them as more rows)."""
        return self.apply(TrimOrPad(max_len, pad_values, feature))

    def batch(
        self,
        batch_size: int,
        drop_last: bool = True,
        pad_last: bool = False,
        pad_values: Mapping[str, Any] | None = None,
    ) -> Self:
        """Stack ``batch_size`` records of one lane into numpy arrays.

        Args:
            batch_size: records per lane batch (``output="lockstep"``: per lane of a step),
                at most ``2**24`` (a lane's records wait in memory until its batch is full).
            drop_last: drop a lane's last partial batch (False: deliver it short).
            pad_last: pad a lane's last partial batch to ``batch_size`` with padding rows
                and add a boolean ``batch_mask`` feature (True on real rows) to every batch,
                so every batch has one shape. In ``lockstep``, lanes that ended contribute
                padding rows (mask False) until every lane of the rank has ended: an eval
                pass delivers every record exactly once. Overrides ``drop_last``.
            pad_values: a padding row's value per feature (default: what the operators
                before pad with, such as ``pack(pad_values=...)`` and ``lm_targets``'s
                ``ignore_id`` for ``targets``; else 0).

        Example::

            pipe = pipe.pack(1024).lm_targets().batch(8, pad_last=True)
            for b in pipe:                 # b["inputs"]: int32[8, 1024]
                loss = step(b, weights=b["batch_mask"])

        The checkpoint cut is on records, before ``batch``: a checkpoint restores into a
        pipeline that differs only in ``batch``'s parameters, whose stream goes on from
        the same record batched the new way (in ``lockstep``, a step then holds every
        lane's next ``batch_size`` records)."""
        if pad_values is None and pad_last:
            pad_values = _upstream_pads(self._ops)
        return self.apply(Batch(batch_size, drop_last, pad_last, pad_values))


def _upstream_pads(ops: Sequence[Operator]) -> dict[str, Any]:
    """The pad value per feature that the operators declare (``pad_values``), later ones
    winning: what a padding row of ``batch(pad_last=True)`` holds."""
    pads: dict[str, Any] = {}
    for op in ops:
        declared = getattr(op, "pad_values", None)
        if isinstance(declared, Mapping):
            pads.update(declared)
    return pads


def _parallelism(p: int) -> int:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"parallelism must be a positive int; got {p!r}")
    return p

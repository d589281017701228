"""Built-in operators and the operator contract."""

from zephon.operators.base import LaneStateOperator, Operator, OpTraits, PipelineContext
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

__all__ = [
    "Batch",
    "DecodeAudio",
    "DecodeImage",
    "DecodeVideo",
    "EnsureMixture",
    "Fetch",
    "Filter",
    "LaneStateOperator",
    "LmTargets",
    "Map",
    "OpTraits",
    "Operator",
    "Pack",
    "PipelineContext",
    "RandomMap",
    "Shuffle",
    "Split",
    "Tokenize",
    "TrimOrPad",
]

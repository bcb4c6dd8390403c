"""Training-time streaming of LeRobot v3 datasets: ``StreamingLeRobotDataset``.

Each rank owns a frame-balanced set of complete episodes; each DataLoader worker owns a part of
them with its own exact-coverage episode pool, byte budget and decoders. Episodes are read as
their parquet rows and the MP4 byte spans of the GOPs they need (located through the MP4
sidecar), decoded from those bytes, and yielded as the items LeRobot's map-style dataset gives.
"""

from .dataset import StreamingLeRobotDataset
from .loader import StreamingLoader, make_loader
from .mixture import MixtureResumeError, StreamingLeRobotMixture
from .options import StreamingOptions
from .ownership import NoEpisodesError
from .planner import EpisodeTooLargeError
from .state import StreamResumeError

__all__ = ["EpisodeTooLargeError", "MixtureResumeError", "NoEpisodesError", "StreamResumeError",
           "StreamingLeRobotDataset", "StreamingLeRobotMixture", "StreamingLoader", "StreamingOptions", "make_loader"]

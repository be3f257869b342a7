"""specdec: speculative decoding on the runtime engine. `generate`, `stream`, the continuous-batching
`Engine`, drafters (named by a `DrafterSpec` string), `SamplingParams`, verification, stats."""

from specdec.capture import DecodeObserver, StateCapture
from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head
from specdec.drafters.eagle.io import load_eagle, save_eagle
from specdec.drafters.spec import DrafterSpec
from specdec.generate import GenerateOutput, generate, stream
from specdec.sampling import SamplingParams
from specdec.serving.engine import Engine, Request
from specdec.stats import AcceptanceStats

__all__ = ["generate", "stream", "GenerateOutput", "Engine", "SamplingParams", "Request",
           "AcceptanceStats", "Drafter", "DrafterSpec", "DraftTree", "Accepted",
           "Eagle3Config", "Eagle3Head", "save_eagle", "load_eagle", "DecodeObserver", "StateCapture"]

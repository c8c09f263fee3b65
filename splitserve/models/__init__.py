"""Models splitserve can serve: the segmented model contract, the built-in zoo and artifact loading."""

from splitserve.models.digits import digits_dataset
from splitserve.models.loader import load_artifact
from splitserve.models.segmented import SegmentedModel, save_safetensors
from splitserve.models.zoo import ZOO, ZooEntry, build_zoo_model, zoo_entry

__all__ = ["ZOO", "SegmentedModel", "ZooEntry", "build_zoo_model", "digits_dataset", "load_artifact", "save_safetensors",
           "zoo_entry"]

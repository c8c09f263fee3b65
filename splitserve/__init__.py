"""splitserve: an inference server for PyTorch models with a split control/data path."""

from splitserve.client import AsyncClient, Client, InferResult, ModelInfo, UdpClient, connect
from splitserve.errors import SplitServeError

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "InferResult", "ModelInfo", "SplitServeError", "UdpClient", "connect", "__version__"]

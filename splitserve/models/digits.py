"""A small CNN trained on scikit-learn's bundled 8x8 digits: a real model with checkable accuracy.

The data ships with scikit-learn, so training needs no download. Training is seeded and
single-threaded, so every machine produces the same weights; they are cached as
safetensors and trained again only when the cache is missing or unreadable.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from splitserve.errors import InvalidInput
from splitserve.models.catalog import DIGITS_FILE
from splitserve.models.segmented import SegmentedModel, load_safetensors, save_safetensors

logger = logging.getLogger(__name__)

_SEED = 0
_EPOCHS = 10
_BATCH = 32
_LR = 3e-3


def digits_dataset() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed split ``(x_train, y_train, x_test, y_test)`` of scikit-learn's digits.

    Images are float32 ``[N, 1, 8, 8]`` scaled from 0..16 to 0..1 (the model's input
    format); labels are int64. A quarter of the samples, stratified, are held out.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]
    y = data.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return x_train, y_train, x_test, y_test


def digits_net() -> SegmentedModel:
    """The untrained architecture: FP32 ``[B, 1, 8, 8]`` -> logits ``[B, 10]`` in three segments."""
    return SegmentedModel([
        nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10)),
    ])


def train_digits() -> SegmentedModel:
    """Train ``digits_net`` on the training split, deterministically; returns it in eval mode."""
    x_train, y_train, _, _ = digits_dataset()
    x, y = torch.from_numpy(x_train), torch.from_numpy(y_train)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = digits_net()
    shuffle = torch.Generator().manual_seed(_SEED)
    opt = torch.optim.Adam(model.parameters(), lr=_LR)
    threads = torch.get_num_threads()
    start = time.perf_counter()
    # One thread: parallel reductions could sum in a different order on another machine.
    torch.set_num_threads(1)
    try:
        # A caller may hold inference mode (e.g. a worker loading models); training needs autograd.
        with torch.inference_mode(False), torch.enable_grad():
            model.train()
            for _ in range(_EPOCHS):
                for idx in torch.randperm(len(x), generator=shuffle).split(_BATCH):
                    loss = F.cross_entropy(model(x[idx])[0], y[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    finally:
        torch.set_num_threads(threads)
        model.eval()
    logger.info("trained digits model in %.1f s", time.perf_counter() - start)
    return model


def load_or_train_digits(cache_dir: Path) -> SegmentedModel:
    """The trained digits model: from ``cache_dir/digits.safetensors``, else trained and cached there.

    Processes racing to fill the cache each train the same weights and write them
    atomically, so whichever rename lands last leaves a complete, identical file.
    """
    path = Path(cache_dir) / DIGITS_FILE
    if path.exists():
        model = digits_net()
        try:
            load_safetensors(model, path)
            return model
        except InvalidInput as e:
            logger.warning("ignoring the digits weights cache: %s", e.message)
    model = train_digits()
    save_safetensors(model, path, metadata={"model": "digits"})
    logger.info("cached digits weights in %s", path)
    return model

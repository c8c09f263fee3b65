"""TorchServe archives read and refused without a server, and the image_classifier's worker
segments on their own: a bad row never fails its batch, fewer than 5 classes pad."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

from splitserve.errors import InvalidInput
from splitserve.models.handler_spec import encode_image
from splitserve.models.handlers import ImagePreprocess, TopK, with_handler
from splitserve.models.mar import serve_archive
from splitserve.models.segmented import SegmentedModel

LIMIT = 1 << 20


def mar(model: dict | None = None, files: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        if model is not None:
            z.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": model}))
        for name, data in (files or {}).items():
            z.writestr(name, data)
    return buf.getvalue()


def serve(data: bytes, **kw):
    return serve_archive(data, LIMIT, name=None, source="x.mar", allow_code=kw.pop("allow_code", False), **kw)


TS = {"modelName": "m", "serializedFile": "m.pt", "handler": "image_classifier", "modelVersion": "2.1"}


def test_a_torchscript_image_classifier_becomes_its_config():
    names = {"0": ["n0", "cat"], "1": "dog"}
    s = serve(mar(TS, {"m.pt": b"ts", "index_to_name.json": json.dumps(names).encode(),
                       "model-config.yaml": b"batchSize: 4\nmaxBatchDelay: 7\n"}))
    assert s.artifact == b"ts" and s.archive.version == "2.1" and s.workers == 1
    cfg = s.config
    assert cfg.artifact.kind == "torchscript" and cfg.handler["index_to_name"] == {"0": "cat", "1": "dog"}
    assert [t.name for t in cfg.inputs] == ["data"] and [t.name for t in cfg.outputs] == ["scores", "classes"]
    assert cfg.max_batch_size == 1  # the manifest names no configFile: TorchServe's defaults
    s = serve(mar({**TS, "configFile": "model-config.yaml"}, {"m.pt": b"ts", "model-config.yaml":
                                                              b"batchSize: 4\nmaxBatchDelay: 7\n"}), batch_size="8")
    assert s.config.max_batch_size == 8 and s.config.batching.max_delay_ms == 7.0  # the call's, then the yaml's


@pytest.mark.parametrize(("data", "words"), [
    (b"\x89PNG not a zip", "a .mar is a zip file"),
    (mar(None, {"m.pt": b"x"}), "no MAR-INF/MANIFEST.json"),
    (mar({**TS, "handler": "my_handler.py"}, {"m.pt": b"x"}), "'my_handler.py' is custom code"),
    (mar({**TS, "handler": "object_detector"}, {"m.pt": b"x"}), "TorchServe's 'object_detector'"),
    (mar({**TS, "serializedFile": None}, {}), "names no serializedFile"),
    (mar(TS, {}), "has no such file"),
    (mar(TS, {"m.pt": b""}), "is empty"),
    (mar({**TS, "modelFile": "model.py"}, {"m.pt": b"x", "model.py": b""}), "--allow-code-artifacts"),
    (mar({**TS, "handler": "base_handler"}, {"m.pt": b"x"}), "declare them"),
    (mar({**TS, "modelName": "../x"}, {"m.pt": b"x"}), "bad model name"),
])
def test_archives_it_cannot_serve_are_refused_naming_what_it_found(data, words):
    with pytest.raises(InvalidInput, match=words):
        serve(data)


def test_an_eager_archive_is_served_whole_under_the_flag():
    data = mar({**TS, "modelFile": "model.py"}, {"m.pt": b"x", "model.py": b""})
    s = serve(data, allow_code=True)
    assert s.config.artifact.kind == "eager" and s.artifact == data


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_bad_row_answers_nan_and_its_batch_mates_their_classes():
    rows = np.stack([encode_image(_png(300, 250), 4096), encode_image(_png(300, 250)[:60], 4096)])
    model = with_handler(SegmentedModel([torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(3))]),
                         {"name": "image_classifier"})
    with torch.inference_mode():
        (x,) = ImagePreprocess()(torch.from_numpy(rows))
        assert x.shape == (2, 3, 224, 224) and torch.isfinite(x[0]).all() and torch.isnan(x[1]).all()
        scores, classes = model(torch.from_numpy(rows))
    assert classes[0].tolist()[3:] == [-1, -1] and sorted(classes[0].tolist()[:3]) == [0, 1, 2]  # 3 classes, padded
    assert classes[1].tolist() == [-1] * 5
    assert torch.isclose(scores[0].sum(), torch.tensor(1.0))
    s, c = TopK()(torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]))
    assert c.tolist() == [[5, 4, 3, 2, 1]]

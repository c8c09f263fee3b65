"""TorchServe's users' path: a .mar built by torch-model-archiver, registered through
TorchServe's management API on its own port, answered by /predictions on its inference
port as TorchServe answers (image_classifier: top 5 as {name: score}), against the same
model run here with TorchServe's preprocessing written out independently."""

from __future__ import annotations

import functools
import http.server
import inspect
import io
import json
import shutil
import subprocess
import sys
import threading
import warnings
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from tests.helpers import start_server

ARCHIVER = shutil.which("torch-model-archiver", path=str(Path(sys.executable).parent))
NAMES = {str(i): ["n%08d" % i, f"class_{i}"] for i in range(10)}

pytestmark = pytest.mark.skipif(ARCHIVER is None, reason="torch-model-archiver is not installed (test extra)")

class TinyCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 7, stride=4)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))


MODEL_PY = "import torch\nfrom torch import nn\n\n\n" + inspect.getsource(TinyCnn)  # the eager archive's model file


def tiny_cnn() -> nn.Module:
    torch.manual_seed(3)
    return TinyCnn().eval()


def png(seed: int, size=(300, 260)) -> bytes:
    rng = np.random.default_rng(seed)
    w, h = size
    base = np.linspace(0, 255, w * h * 3).reshape(h, w, 3) * rng.uniform(0.2, 1.0, 3)
    pixels = np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def torchserve_preprocess(data: bytes) -> torch.Tensor:
    """torchvision's Resize(256), CenterCrop(224), ToTensor, Normalize(ImageNet) on a PIL image."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    if w <= h:
        size = (256, int(256 * h / w))
    else:
        size = (int(256 * w / h), 256)
    img = img.resize(size, Image.BILINEAR)
    left, top = int(round((size[0] - 224) / 2.0)), int(round((size[1] - 224) / 2.0))
    x = torch.from_numpy(np.asarray(img.crop((left, top, left + 224, top + 224)), np.float32) / 255).permute(2, 0, 1)
    mean, std = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    return (x - mean) / std


def archive(tmp: Path, store: Path, name: str, *, eager: bool = False, handler: str = "image_classifier",
            config_yaml: str | None = None) -> Path:
    model = tiny_cnn()
    (tmp / "index_to_name.json").write_text(json.dumps(NAMES))
    args = [ARCHIVER, "--model-name", name, "--version", "1.0", "--handler", handler,
            "--extra-files", str(tmp / "index_to_name.json"), "--export-path", str(store), "--force"]
    if config_yaml is not None:
        (tmp / "model-config.yaml").write_text(config_yaml)
        args += ["--config-file", str(tmp / "model-config.yaml")]
    if eager:
        (tmp / "model.py").write_text(MODEL_PY)
        torch.save(model.state_dict(), tmp / "weights.pth")
        args += ["--model-file", str(tmp / "model.py"), "--serialized-file", str(tmp / "weights.pth")]
    else:
        with warnings.catch_warnings():  # torch.jit is deprecated upstream; TorchServe's users have such files
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.script(model).save(str(tmp / "cnn.pt"))
        args += ["--serialized-file", str(tmp / "cnn.pt")]
    subprocess.run(args, check=True, cwd=tmp, capture_output=True)
    return store / f"{name}.mar"


def expected(data: bytes) -> dict[str, float]:
    with torch.inference_mode():
        probs = torch.softmax(tiny_cnn()(torchserve_preprocess(data)[None]), dim=1)[0]
    scores, classes = torch.topk(probs, 5)
    return {NAMES[str(int(c))][-1]: float(s) for s, c in zip(scores, classes)}


@pytest.fixture(scope="module")
def ts(tmp_path_factory):
    data = tmp_path_factory.mktemp("ts")
    store = data / "store"
    store.mkdir()
    s = start_server(data, "--ts-inference-port", "0", "--ts-management-port", "0", "--model-store", str(store),
                     http=True)
    token = (data / "token").read_text().strip()
    inf = httpx.Client(base_url=f"http://127.0.0.1:{s.info['ts_inference_port']}", timeout=60)
    mgmt = httpx.Client(base_url=f"http://127.0.0.1:{s.info['ts_management_port']}", timeout=120,
                        headers={"Authorization": f"Bearer {token}"})
    yield s, store, inf, mgmt, data
    inf.close()
    mgmt.close()
    assert s.stop() == 0


def same(got: dict[str, float], want: dict[str, float]) -> bool:
    """The same classes, best first, and the same scores (batches of other sizes round differently)."""
    return list(got) == list(want) and np.allclose(list(got.values()), list(want.values()), atol=1e-4)


def ts_error(r: httpx.Response, code: int, words: str) -> None:
    assert r.status_code == code, r.text
    body = r.json()
    assert body["code"] == code and body["type"] and words in body["message"], body


def test_mar_registered_and_predicted_as_torchserve_answers(ts, tmp_path):
    s, store, inf, mgmt, _ = ts
    archive(tmp_path, store, "cnn")
    r = mgmt.post("/models", params={"url": "cnn.mar", "initial_workers": 1, "batch_size": 4,
                                     "max_batch_delay": 20, "synchronous": "true"})
    assert r.status_code == 200, r.text
    assert r.json() == {"status": 'Model "cnn" Version: 1.0 registered with 1 initial workers'}
    assert inf.get("/ping").json() == {"status": "Healthy"}
    image = png(1)
    got = inf.post("/predictions/cnn", content=image).json()
    want = expected(image)
    assert same(got, want)  # the same top class, and the rest
    assert same(inf.post("/predictions/cnn/1.0", files={"data": ("x.png", image)}).json(), got)  # multipart, version
    # the same on splitserve's own HTTP port, beside /v2
    with httpx.Client(base_url=s.http, timeout=60) as h:
        assert same(h.post("/predictions/cnn", content=image).json(), got)
    desc = mgmt.get("/models/cnn").json()
    assert desc[0]["modelName"] == "cnn" and desc[0]["modelVersion"] == "1.0" and desc[0]["batchSize"] == 4
    assert desc[0]["maxBatchDelay"] == 20 and desc[0]["workers"][0]["status"] == "READY"
    assert {"modelName": "cnn", "modelUrl": "cnn.mar"} in mgmt.get("/models").json()["models"]
    assert mgmt.put("/models/cnn/1.0/set-default").status_code == 200
    ts_error(mgmt.put("/models/cnn/2.0/set-default"), 404, "2.0")
    assert mgmt.put("/models/cnn", params={"min_worker": 2}).json() == {"status": "Workers scaled to 2 for model: cnn"}
    assert mgmt.get("/models/cnn").json()[0]["minWorkers"] == 2
    assert same(inf.post("/predictions/cnn", content=image).json(), got)


def test_bad_input_gets_exactly_one_answer_and_costs_no_one_else(ts, tmp_path):
    s, store, inf, mgmt, _ = ts
    if mgmt.get("/models/cnn").status_code != 200:
        archive(tmp_path, store, "cnn")
        assert mgmt.post("/models", params={"url": "cnn.mar", "batch_size": 4, "max_batch_delay": 20}).status_code == 200
    good = png(2)
    truncated = png(3)[:200]  # a PNG header Pillow reads, data the worker cannot decode
    answers: dict[str, httpx.Response] = {}

    def call(key, body):
        with httpx.Client(base_url=str(inf.base_url), timeout=60) as c:
            answers[key] = c.post("/predictions/cnn", content=body)

    threads = [threading.Thread(target=call, args=(k, b)) for k, b in
               (("good", good), ("truncated", truncated), ("good2", good))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert same(answers["good"].json(), expected(good)) and same(answers["good2"].json(), expected(good))
    ts_error(answers["truncated"], 400, "could not be decoded")
    ts_error(inf.post("/predictions/cnn", content=b"not an image at all"), 400, "not an image")
    ts_error(inf.post("/predictions/cnn", content=b"\0" * ((1 << 20) + 1)), 413, "limit")
    ts_error(inf.post("/predictions/nope", content=good), 404, "nope")
    ts_error(inf.post("/predictions/cnn/9.9", content=good), 404, "9.9")
    assert same(inf.post("/predictions/cnn", content=good).json(), expected(good))


def test_bad_archives_and_urls_are_refused_naming_what_was_found(ts, tmp_path):
    s, store, inf, mgmt, _ = ts
    (store / "junk.mar").write_bytes(b"GIF89a not a zip")
    ts_error(mgmt.post("/models", params={"url": "junk.mar"}), 400, "a .mar is a zip file")
    with zipfile.ZipFile(store / "nomanifest.mar", "w") as z:
        z.writestr("model.pt", b"x")
    ts_error(mgmt.post("/models", params={"url": "nomanifest.mar"}), 400, "no MAR-INF/MANIFEST.json")
    (tmp_path / "handler.py").write_text("def handle(data, context):\n    return data\n")
    archive(tmp_path, store, "custom", handler=str(tmp_path / "handler.py"))
    ts_error(mgmt.post("/models", params={"url": "custom.mar"}), 400, "'handler.py' is custom code")
    archive(tmp_path, store, "eager", eager=True)
    ts_error(mgmt.post("/models", params={"url": "eager.mar"}), 400, "--allow-code-artifacts")
    ts_error(mgmt.post("/models", params={"url": "https://example.com/x.mar"}), 400, "--ts-allow-remote-urls")
    ts_error(mgmt.post("/models", params={"url": "../token"}), 400, "directly in the model store")
    ts_error(mgmt.post("/models", params={"url": "absent.mar"}), 404, "absent.mar")
    ts_error(mgmt.post("/models"), 400, "url is required")
    ts_error(httpx.post(mgmt.base_url.join("/models"), params={"url": "cnn.mar"}), 401, "Bearer")
    names = [m["modelName"] for m in mgmt.get("/models", params={"limit": 1000}).json()["models"]]
    assert not {"junk", "nomanifest", "custom", "eager"} & set(names)


def test_unregister(ts, tmp_path):
    s, store, inf, mgmt, _ = ts
    archive(tmp_path, store, "gone")
    assert mgmt.post("/models", params={"url": "gone.mar"}).status_code == 200
    ts_error(mgmt.delete("/models/gone/3.0"), 404, "3.0")
    assert mgmt.delete("/models/gone/1.0").json() == {"status": 'Model "gone" Version: 1.0 unregistered'}
    ts_error(mgmt.get("/models/gone"), 404, "gone")


BASE_YAML = """batchSize: 2
splitserve:
  inputs: [{name: x, datatype: FP32, shape: [3, 224, 224]}]
  outputs: [{name: y, datatype: FP32, shape: [10]}]
"""


class ArchiveServer(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test's output stays the test's
        pass


def test_eager_and_remote_archives_served_with_their_flags(tmp_path):
    store, remote = tmp_path / "store", tmp_path / "remote"
    store.mkdir()
    remote.mkdir()
    archive(tmp_path, store, "eager", eager=True)
    archive(tmp_path, remote, "base", handler="base_handler", config_yaml=BASE_YAML)
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(ArchiveServer, directory=str(remote)))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    s = start_server(tmp_path / "data", "--model-store", str(store), "--allow-code-artifacts",
                     "--ts-allow-remote-urls", http=True)
    try:
        auth = {"Authorization": f"Bearer {(tmp_path / 'data' / 'token').read_text().strip()}"}
        with httpx.Client(base_url=s.http, timeout=120, headers=auth) as h:
            r = h.post("/models", params={"url": "eager.mar"})
            assert r.status_code == 200, r.text
            image = png(4)
            assert same(h.post("/predictions/eager", content=image).json(), expected(image))
            url = f"http://127.0.0.1:{files.server_address[1]}"
            ts_error(h.post("/models", params={"url": f"{url}/absent.mar"}), 400, "HTTP 404")
            r = h.post("/models", params={"url": f"{url}/base.mar"})
            assert r.status_code == 200, r.text
            x = torchserve_preprocess(image)
            with torch.inference_mode():
                want = tiny_cnn()(x[None])[0].numpy()
            got = h.post("/predictions/base", json=x.tolist()).json()
            assert np.allclose(got, want, atol=1e-4)
            ts_error(h.post("/predictions/base", json=[[1.0, 2.0]]), 400, "shape [3, 224, 224]")
            ts_error(h.post("/predictions/base", content=b"{not json"), 400, "not valid JSON")
    finally:
        files.shutdown()
        files.server_close()
        assert s.stop() == 0

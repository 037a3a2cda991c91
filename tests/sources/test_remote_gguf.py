"""Remote GGUFs read with HTTP range requests (``zoo.sources.remote``), against a real HTTP server on
127.0.0.1 (uvicorn + Starlette's static files, which honour ``Range``): ``zoo plan`` reads only the
header, ``zoo audit`` only the header and the chosen experts/rows, and every read equals the local
file's. The Hugging Face Hub is the same code path with an ``hf://`` reference resolved to its
``resolve`` URL (no network here: only the resolution is checked)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tests.support.audit_files import BANK, EXPERTS, ROWS
from tests.support.gguf_files import metadata_of, write_gguf
from tests.support.paths import DATA
from zoo.cli import main
from zoo.server.app import ServerThread
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource
from zoo.sources.gguf_header import check_header
from zoo.sources.remote import HEADER_FIRST, _resolve
from zoo.tools.audit import audit
from zoo.tools.plan import plan_gguf

GLM = "glm53-q256-udmix.gguf"


@pytest.fixture(scope="module")
def www(tmp_path_factory, audit_files):
    """Files served over HTTP: the GLM fixture, a 3-shard split copy of it, the audit pair."""
    root = tmp_path_factory.mktemp("www")
    shutil.copy(DATA / GLM, root / GLM)
    src = GGUFSource(DATA / GLM)
    tensors = {k: (src.read(k), src.info(k).qtype) for k in src.keys()}
    write_gguf(root / "split.gguf", src.architecture, metadata_of(DATA / GLM), tensors,
               split_max_tensors=len(tensors) // 3 + 1)
    for f in audit_files:
        shutil.copy(f, root / Path(f).name)
    app = Starlette(routes=[Mount("/files", StaticFiles(directory=root)),
                            Route("/norange/{name}", lambda r: Response((root / GLM).read_bytes())),
                            Route("/gated/{name}", lambda r: Response("gated", status_code=401))])
    with ServerThread(app) as server:
        yield server.url, root


@pytest.fixture(autouse=True)
def mirror(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_REMOTE_CACHE", str(tmp_path / "mirror"))
    return tmp_path / "mirror"


def test_plan_reads_only_the_header(www):
    url, root = www
    remote = GGUFSource(f"{url}/files/{GLM}")
    size = (root / GLM).stat().st_size
    header = check_header(root / GLM, memoryview((root / GLM).read_bytes()))
    assert remote.remote.fetched_bytes <= max(HEADER_FIRST, 4 * header) + 1 < size / 4     # + the size probe
    local_plan = plan_gguf(root / GLM, devices=8).to_dict()
    assert plan_gguf(f"{url}/files/{GLM}", devices=8).to_dict() == local_plan
    assert remote.metadata == GGUFSource(root / GLM).metadata


def test_reads_equal_the_local_file_and_fetch_only_what_they_touch(www):
    url, root = www
    local, remote = GGUFSource(root / GLM), GGUFSource(f"{url}/files/{GLM}")
    key = "blk.1.ffn_down_exps.weight"
    before = remote.remote.fetched_bytes
    part = remote.read(key, (2, slice(10, 20)))
    np.testing.assert_array_equal(part, local.read(key, (2, slice(10, 20))))
    assert remote.remote.fetched_bytes - before == part.nbytes                 # exactly the rows asked for
    for k in local.keys():
        np.testing.assert_array_equal(remote.read(k), local.read(k), err_msg=k)
    again = GGUFSource(f"{url}/files/{GLM}")                                   # the mirror is reused
    np.testing.assert_array_equal(again.read(key), local.read(key))
    assert again.remote.fetched_bytes == 1                                     # the size probe only


def test_split_set(www):
    url, root = www
    first = sorted(p.name for p in root.glob("split-*.gguf"))[0]
    assert first.endswith("-00001-of-00003.gguf")
    local, remote = GGUFSource(root / first), GGUFSource(f"{url}/files/{first}")
    assert len(remote.files) == 3 and remote.keys() == local.keys()
    for k in local.keys():
        np.testing.assert_array_equal(remote.read(k), local.read(k), err_msg=k)
    with pytest.raises(SourceError, match="first shard"):
        GGUFSource(f"{url}/files/{first.replace('00001-of', '00002-of')}")


def test_audit_reads_the_chosen_experts_and_rows(www, audit_files):  # noqa: F811
    url, root = www
    quant, ref = (Path(f).name for f in audit_files)
    tensors = ["blk.0.*"]
    want = audit(root / quant, root / ref, tensors, experts=EXPERTS, rows=ROWS)
    q_src, r_src = GGUFSource(f"{url}/files/{quant}"), GGUFSource(f"{url}/files/{ref}")
    got = audit(q_src, r_src, tensors, experts=EXPERTS, rows=ROWS)
    assert [r.__dict__ for r in got] == [r.__dict__ for r in want]
    bank = r_src.info(BANK)
    bank_bytes = bank.nbytes // bank.shape[0] // bank.shape[1] * (ROWS[1] - ROWS[0]) * len(EXPERTS)
    others = sum(r_src.info(k).nbytes for k in r_src.keys() if k != BANK)
    assert r_src.remote.fetched_bytes <= HEADER_FIRST + 1 + bank_bytes + others < r_src.files[0].stat().st_size


def test_changed_remote_file_is_fetched_afresh(www, mirror):
    url, root = www
    name = "changing.gguf"
    shutil.copy(DATA / "qwen38-q256-udmix.gguf", root / name)
    first = GGUFSource(f"{url}/files/{name}")
    key = first.keys()[0]
    first.read(key)
    shutil.copy(DATA / GLM, root / name)                   # same name, other content
    second = GGUFSource(f"{url}/files/{name}")
    assert second.keys() == GGUFSource(DATA / GLM).keys()
    k = "blk.2.ffn_gate_exps.weight"
    np.testing.assert_array_equal(second.read(k), GGUFSource(DATA / GLM).read(k))


def test_errors_are_clear(www):
    url, _ = www
    with pytest.raises(SourceError, match="no such remote file"):
        GGUFSource(f"{url}/files/missing.gguf")
    with pytest.raises(SourceError, match="range request"):
        GGUFSource(f"{url}/norange/{GLM}")
    with pytest.raises(SourceError, match="access denied .*HF_TOKEN"):
        GGUFSource(f"{url}/gated/{GLM}")
    with pytest.raises(SourceError, match=r"cannot read bytes"):
        GGUFSource("http://127.0.0.1:9/nothing-listens-here.gguf")
    with pytest.raises(SourceError, match="OWNER/REPO"):
        GGUFSource("hf://just-a-name.gguf")


def test_hub_references_resolve_to_the_resolve_url():
    url, headers = _resolve("hf://unsloth/GLM-5.3-Flash-GGUF@main/UD-IQ3_XXS/m-00001-of-00004.gguf")
    assert url == "https://huggingface.co/unsloth/GLM-5.3-Flash-GGUF/resolve/main/UD-IQ3_XXS/m-00001-of-00004.gguf"
    assert "user-agent" in {k.lower() for k in headers}
    url, _ = _resolve("hf://Qwen/Qwen3.8-27B-GGUF/q.gguf")
    assert url == "https://huggingface.co/Qwen/Qwen3.8-27B-GGUF/resolve/main/q.gguf"


def test_cli_plan_and_audit_take_urls(www, audit_files, capsys):  # noqa: F811
    url, root = www
    quant, ref = (Path(f).name for f in audit_files)
    for args in (["plan", "{}" + GLM, "--json"], ["audit", "{}" + quant, "{}" + ref, "--tensors", "blk.0.*",
                                                  "--experts", "1,3", "--rows", "16:48"]):
        assert main([a.format(str(root) + "/") for a in args]) in (0, None)
        local = capsys.readouterr().out
        assert main([a.format(f"{url}/files/") for a in args]) in (0, None)
        remote = capsys.readouterr().out
        assert remote.replace(f"{url}/files/", "").replace(str(root) + "/", "") == local.replace(str(root) + "/", "")

"""The wheel users install: built from this checkout, installed (not editable) into a scratch virtualenv
and run from outside the repo.

The suite itself runs on an editable install, which serves every file of the checkout whether the wheel
ships it or not (``zoo.images`` was once missing from it). Here the wheel is built with the running
interpreter (no build isolation: no network), checked against the files git tracks under ``zoo/``, and
installed with ``pip --no-index --no-deps`` into a virtualenv under ``tmp_path``. The dependencies come
from the running venv through a ``.pth`` file holding its site-packages as a plain path line: Python adds
that directory to ``sys.path`` without running the ``.pth`` hooks in it, so the checkout's editable
``zoo`` stays out and the scratch interpreter can only import the installed one (checked). It then imports
every module, generates with the embedded tiny model and serves one chat completion over loopback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300

# Run by the scratch interpreter: import every module of the installed zoo; one JSON line on stdout.
IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil
import zoo
modules, failed = [], {}
def record(name):
    failed[name] = "error while walking the package"
for info in pkgutil.walk_packages(zoo.__path__, "zoo.", onerror=record):
    if info.name == "zoo.__main__":
        continue
    modules.append(info.name)
    try:
        importlib.import_module(info.name)
    except BaseException as e:
        failed[info.name] = f"{type(e).__name__}: {e}"
print(json.dumps({"zoo": zoo.__file__, "modules": modules, "failed": failed}))
"""


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    """``cmd``, its output captured; a failure shows both streams."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, **kw)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}\nstdout:\n{done.stdout[-3000:]}\n" \
                                 f"stderr:\n{done.stderr[-3000:]}"
    return done


def _source_tree(dest: Path) -> Path:
    """A copy of what setuptools reads: the top-level files and ``zoo/`` (no bytecode). Building in the
    checkout itself would write build/ and zoo.egg-info into it, and a stale build/lib (a module since
    removed) would end up in the wheel."""
    dest.mkdir()
    for f in REPO.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    shutil.copytree(REPO / "zoo", dest / "zoo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _clean_env(**extra: str) -> dict[str, str]:
    """Our environment without anything that points Python at the checkout or another venv; JAX on the
    CPU with the suite's compilation cache (tests/conftest.py); no network for Hugging Face."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               JAX_COMPILATION_CACHE_DIR=os.environ["JAX_COMPILATION_CACHE_DIR"], **extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    assert importlib.util.find_spec("setuptools"), \
        "building the wheel without build isolation needs setuptools in this venv"
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_tree(tmp / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "-w", tmp / "dist", src])
    (built,) = (tmp / "dist").glob("zoo-*.whl")
    return built


@pytest.fixture(scope="module")
def scratch_python(wheel, tmp_path_factory) -> Path:
    """The interpreter of a fresh virtualenv holding the wheel (not editable) and, through a ``.pth`` path
    line, the running venv's site-packages (the dependencies)."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q", wheel])
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "running_venv_site_packages.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def _tracked_under_zoo() -> list[str]:
    """Files git tracks under zoo/ that exist in the working tree (repo-relative, posix)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing says which files belong to the package")
    out = _run(["git", "-C", REPO, "ls-files", "-z", "--", "zoo"]).stdout
    return sorted(f for f in out.split("\0") if f and "__pycache__" not in f and (REPO / f).is_file())


def test_wheel_ships_every_package_and_data_file(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    tracked = _tracked_under_zoo()
    data = [f for f in tracked if not f.endswith(".py")]
    assert any(f.startswith("zoo/assets/") for f in data) and any(f.startswith("zoo/configs/") for f in data)
    assert [f for f in data if f not in names] == [], "data files the wheel leaves out"
    assert [f for f in tracked if f.endswith(".py") and f not in names] == [], "modules the wheel leaves out"
    packages = sorted(str(p.parent.relative_to(REPO).as_posix()) for p in (REPO / "zoo").rglob("__init__.py")
                      if "__pycache__" not in p.parts)
    assert "zoo/images" in packages
    assert [p for p in packages if f"{p}/__init__.py" not in names] == [], "packages the wheel leaves out"


def test_installed_wheel_imports_every_module(scratch_python, tmp_path):
    done = _run([scratch_python, "-c", IMPORT_EVERY_MODULE], cwd=tmp_path, env=_clean_env())
    report = json.loads(done.stdout.strip().splitlines()[-1])
    installed = Path(report["zoo"]).resolve()
    assert installed.is_relative_to(scratch_python.parents[1].resolve()), f"zoo imported from {installed}"
    assert not installed.is_relative_to(REPO)
    assert report["failed"] == {}
    ours = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            for p in (REPO / "zoo").rglob("*.py") if (p.parent / "__init__.py").exists()}
    assert ours - {"zoo", "zoo.__main__"} - set(report["modules"]) == set(), "modules of the checkout not installed"


def test_installed_wheel_generates(scratch_python, tmp_path):
    done = _run([scratch_python, "-m", "zoo", "generate", "--model", "qwen38-tiny", "--prompt", "What is 2 + 3?",
                 "--max-tokens", "8"], cwd=tmp_path, env=_clean_env())
    assert done.stdout.strip(), done.stderr[-3000:]
    assert "[zoo] loaded qwen38-tiny" in done.stderr


def test_installed_wheel_serves_a_chat_completion(scratch_python, tmp_path):
    key = "packaging-test-key"
    log = tmp_path / "serve.stderr"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([scratch_python, "-m", "zoo", "serve", "--port", "0", "--api-key", key,
                                 "--log-level", "warning", "--max-batch", "2"],
                                cwd=tmp_path, env=_clean_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        printed = {}
        for line in proc.stdout:                       # the banner (zoo/cli/serve.py); the socket is bound
            name, _, value = line.strip().partition(": ")
            printed[name] = value.strip()
            if name == "API key":
                break
        assert printed.get("API key") == key, f"no banner; stderr:\n{log.read_text()[-3000:]}"
        body = {"model": "qwen38-tiny", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 4}
        req = urllib.request.Request(f"{printed['OpenAI base URL']}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=SUBPROCESS_TIMEOUT_S) as r:
                status, answer = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            status, answer = e.code, e.read().decode(errors="replace")
        assert status == 200, f"{status}: {answer}\nstderr:\n{log.read_text()[-3000:]}"
        assert 1 <= answer["usage"]["completion_tokens"] <= 4
        assert isinstance(answer["choices"][0]["message"]["content"], str)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.stdout.close()
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "nothing (killed after SIGINT and 60 s)"
    assert rc == 0, f"zoo serve exited {rc}; stderr:\n{log.read_text()[-3000:]}"

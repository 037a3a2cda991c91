"""``zoo.kaggle``, the notebooks' helpers, on what the notebooks do not reach: a server that cannot
start, a cache of another recipe under the search root, a failing command, a malformed GGUF name."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest

from zoo import kaggle


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path, monkeypatch):
    """Its own temporary log (no ``log_path``) is kept after a failed start, for reading; the serving
    notebooks' tests check that a clean stop removes it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = kaggle.ZooServer("--model", "no-such-model", start_timeout_s=120)
    with pytest.raises(RuntimeError, match="did not start .*exit status 2") as err:
        server.start()
    assert "unknown model 'no-such-model'" in str(err.value)
    assert server.proc.returncode == 2 and server.stop() == 2
    assert server.log_path.parent == tmp_path and "unknown model" in server.log_path.read_text()


def test_a_start_that_fails_keeps_its_log_even_after_a_clean_exit(tmp_path, monkeypatch):
    """``zoo serve --help`` exits 0 without a banner: a failed start, whose log is kept though the
    process's exit status is 0 (only a server that became ready removes its log on a clean exit)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = kaggle.ZooServer("--help", start_timeout_s=120)
    with pytest.raises(RuntimeError, match="did not start .*exit status 0"):
        server.start()
    assert server.stop() == 0 and server.log_path.exists() and server.log_path.parent == tmp_path


def test_find_cache_names_why_an_entry_of_another_recipe_is_not_used(tmp_path, monkeypatch):
    dataset = tmp_path / "input" / "my-dataset"
    built = subprocess.run([sys.executable, "-m", "zoo", "cache", "build", "glm53-tiny", "--quant", "int8",
                            "--dir", str(dataset)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    monkeypatch.setenv("ZOO_CACHE_SEARCH", str(tmp_path / "input"))
    entry = next(dataset.glob("*/manifest.json")).parent
    found = kaggle.find_cache("glm53-tiny", "int8")
    assert found.entry == entry and found.size_bytes == kaggle.entry_bytes(entry) > 0 and found.rejected == []
    other = kaggle.find_cache("glm53-tiny", "Q8_0", cache=tmp_path / "empty")
    assert other.entry is None and other.size_bytes == 0
    assert other.rejected == [f"{entry}: quant is 'int8' in the cache, 'Q8_0' requested"]
    assert "not usable" in str(other) and "loads from its sources" in str(other)
    assert kaggle.find_cache("qwen38-tiny").rejected == []           # another model's entry: no candidate


def test_zoo_command_shows_output_and_raises_on_failure(capsys):
    assert "glm53-flash" in kaggle.zoo_command("models")
    assert "glm53-flash" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match=r"no-such-model --quant int8 exited with status 2:\nzoo: error: unknown"):
        kaggle.zoo_command("plan", "no-such-model", "--quant", "int8")


def test_plan_for_a_whole_gguf_recipe_needs_the_file():
    with pytest.raises(ValueError, match="whole GGUF: give its file"):
        kaggle.plan_for("qwen38-27b", "UD-IQ3_XXS")
    assert kaggle.plan_for("glm53-flash", "UD-IQ3_XXS", 8, "ep").per_device_bytes > 15 * 2**30


def test_fetch_sources_rejects_a_gguf_that_is_not_an_hf_reference():
    with pytest.raises(ValueError, match="expected hf://OWNER/REPO"):
        kaggle.fetch_sources("qwen38-tiny", gguf="/local/file.gguf")


def test_eval_text_is_the_file_given_and_a_missing_one_is_named(tmp_path):
    text = tmp_path / "wiki.test.raw"
    text.write_text("some text")
    assert kaggle.eval_text(text) == str(text)
    with pytest.raises(FileNotFoundError, match="no evaluation text at .*none.txt"):
        kaggle.eval_text(tmp_path / "none.txt")

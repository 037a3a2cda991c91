"""The file pass 1 of ``zoo eval`` writes and pass 2 reads: ``BASE.npz``.

    with BaseWriter(path, meta, windows, vocab) as w:    one ``w.add(...)`` per window, in order
        w.add(encoded, next_logprob)
    base = BaseFile(path)                                  ``.meta``, ``.windows``, the per-token arrays
    for encoded in base.window_encoded(): ...              each window's ``Encoded``, codes streamed

A NumPy ``.npz`` (a zip of ``.npy`` members, stored uncompressed) holding, for the scored tokens of
every window (``zoo.eval.windows``; ``N = W * scored`` tokens in window order):

* ``meta`` (a JSON string): ``format`` ("zoo-eval-base/1"), ``ctx``, ``first``, ``scored``,
  ``windows``, ``vocab``, ``tokenizer`` (``windows.tokenizer_fingerprint``), and where the figures came
  from (``model``, ``quant``, ``dtype``);
* ``tokens`` int32 [W, ctx]: the windows themselves;
* ``codes`` uint16 [N, V], ``low`` / ``step`` float64 [N], ``top_ids`` int32 [N, K] and
  ``top_logprobs`` float64 [N, K]: the reference's log-softmax (``zoo.eval.logprob_codec.Encoded``;
  ``top_ids[:, 0]`` is its most likely token), the codes written window by window, never whole in memory;
* ``next_logprob`` float64 [N]: the exact log-probability of the token that follows (perplexity).

The writer works on ``PATH.partial`` and renames it only when every window is in: an interrupted pass
leaves no ``BASE.npz`` behind (and removes the partial file when it fails inside Python).
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np

from zoo.eval.logprob_codec import Encoded

FORMAT = "zoo-eval-base/1"
PER_TOKEN = {"low": np.float64, "step": np.float64, "next_logprob": np.float64, "top_ids": np.int32,
             "top_logprobs": np.float64}


def _write_array(zf: zipfile.ZipFile, name: str, array: np.ndarray) -> None:
    with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array(f, np.asarray(array, order="C"), allow_pickle=False)


class BaseWriter:
    """Writes ``path`` (module doc): ``meta`` a JSON-able dict, ``windows`` int32 [W, ctx], ``vocab`` V."""

    def __init__(self, path: str | Path, meta: dict, windows: np.ndarray, vocab: int):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.scored = int(meta["scored"])
        self.total = len(windows) * self.scored
        self.meta = {"format": FORMAT, **meta, "windows": len(windows), "vocab": int(vocab)}
        self.windows = windows
        self.vocab = int(vocab)
        self.rows = 0
        self.per_token = {name: [] for name in PER_TOKEN}

    def __enter__(self) -> "BaseWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._zip = zipfile.ZipFile(self.partial, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._codes = self._zip.open("codes.npy", "w", force_zip64=True)
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint16)), "fortran_order": False,
                  "shape": (self.total, self.vocab)}
        np.lib.format.write_array_header_2_0(self._codes, header)
        return self

    def add(self, encoded: Encoded, next_logprob) -> None:
        """One window's scored tokens: its encoded reference (codes [scored, V]) and the log-probability
        of each one's next token [scored]."""
        if encoded.codes.shape != (self.scored, self.vocab):
            raise ValueError(f"a window's codes have shape {encoded.codes.shape}, expected {(self.scored, self.vocab)}")
        self._codes.write(np.ascontiguousarray(encoded.codes, np.uint16).tobytes())
        for name, value in (("low", encoded.low), ("step", encoded.step), ("next_logprob", next_logprob),
                            ("top_ids", encoded.top_ids), ("top_logprobs", encoded.top_logprobs)):
            self.per_token[name].append(np.asarray(value, PER_TOKEN[name]))
        self.rows += self.scored

    def __exit__(self, kind, error, tb) -> None:
        complete = kind is None and self.rows == self.total
        try:
            self._codes.close()
            if complete:
                _write_array(self._zip, "meta", np.array(json.dumps(self.meta)))
                _write_array(self._zip, "tokens", self.windows.astype(np.int32))
                for name, parts in self.per_token.items():
                    _write_array(self._zip, name, np.concatenate(parts))
        finally:
            self._zip.close()
            if complete:
                os.replace(self.partial, self.path)
            else:
                self.partial.unlink(missing_ok=True)
        if kind is None and not complete:
            raise ValueError(f"{self.rows // self.scored} windows written of {len(self.windows)}: "
                             f"{self.path} not written")


class BaseFile:
    """A ``BASE.npz`` opened for pass 2: ``meta`` (dict), ``windows`` int32 [W, ctx], and the per-token
    arrays of ``PER_TOKEN`` as attributes; ``window_encoded()`` streams the windows' references."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no reference file {self.path} (write one with `zoo eval base`)")
        try:
            with np.load(self.path, allow_pickle=False) as npz:
                self.meta = json.loads(str(npz["meta"]))
                if self.meta.get("format") != FORMAT:
                    raise ValueError(f"format {self.meta.get('format')!r}")
                self.windows = npz["tokens"]
                for name in PER_TOKEN:
                    setattr(self, name, npz[name])
        except (ValueError, KeyError, OSError, zipfile.BadZipFile) as e:
            raise ValueError(f"{self.path} is not a reference file written by `zoo eval base` "
                             f"({FORMAT}): {e}") from None
        self.scored = int(self.meta["scored"])
        self.vocab = int(self.meta["vocab"])
        tokens = self.windows.shape[0] * self.scored
        if self.windows.shape != (self.meta["windows"], self.meta["ctx"]) or len(self.low) != tokens:
            raise ValueError(f"{self.path}: its arrays do not match its meta ({self.meta})")

    def window_encoded(self):
        """Each window's ``Encoded`` reference (codes uint16 [scored, V]), in order, the codes read from the
        file as they are needed."""
        with zipfile.ZipFile(self.path) as zf, zf.open("codes.npy") as f:
            version = np.lib.format.read_magic(f)
            fmt = np.lib.format
            shape, _, dtype = (fmt.read_array_header_2_0 if version == (2, 0) else fmt.read_array_header_1_0)(f)
            want = (len(self.low), self.vocab)
            if shape != want or dtype != np.uint16:
                raise ValueError(f"{self.path}: codes of shape {shape} / {dtype}, expected {want} uint16")
            size = self.scored * self.vocab * 2
            for w in range(len(self.windows)):
                data = f.read(size)
                if len(data) != size:
                    raise ValueError(f"{self.path} is truncated")
                at = slice(w * self.scored, (w + 1) * self.scored)
                yield Encoded(np.frombuffer(data, np.uint16).reshape(self.scored, self.vocab), self.low[at],
                              self.step[at], self.top_ids[at], self.top_logprobs[at])

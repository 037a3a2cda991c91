"""Writing GGUF files in tests with ``gguf.GGUFWriter``: copies of a fixture's metadata, tensors of
any type (float arrays, gguf-quantized, or raw blocks), single files or split sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gq

from zoo.formats.ggml import QType
from zoo.sources.gguf import GGUFSource


def metadata_of(path: Path) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """Every key of a GGUF file as ``(key, value, type, array element type)`` (general.architecture
    and the split keys excepted: the writer adds them)."""
    out = []
    for key, field in GGUFReader(path).fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.startswith("split."):
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        out.append((key, field.contents(), field.types[0], sub))
    return out


def write_gguf(path: Path, arch: str, metadata, tensors: dict[str, tuple[np.ndarray, QType]],
               split_max_tensors: int = 0) -> Path:
    """Write ``tensors`` (name -> (numpy-order array, type)) to ``path``; returns the first file.

    A float array with a block type is quantized by gguf; a ``uint8`` array with a block type is
    taken as its raw blocks ``[*shape[:-1], row_bytes]``; F32 / F16 arrays are written as they are,
    BF16 through gguf's converter.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for key, value, vtype, sub in metadata:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for name, (array, qtype) in tensors.items():
        if qtype in (QType.F32, QType.F16):
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32 if qtype == QType.F32 else np.float16))
        elif array.dtype == np.uint8:
            writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gq.quantize(np.asarray(array, np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(path))[0]


def dequantized(src: GGUFSource, key: str) -> np.ndarray:
    """The oracle: a tensor's values as gguf's numpy dequantizer gives them (floats: converted)."""
    info = src.info(key)
    data = src.read(key)
    return gq.dequantize(data, info.qtype) if info.quantized else data.astype(np.float32)


def write_dense_copy(src: GGUFSource, path: Path, metadata) -> Path:
    """Every tensor of ``src`` as F32 holding gguf-dequantized values."""
    return write_gguf(path, src.architecture, metadata, {k: (dequantized(src, k), QType.F32) for k in src.keys()})


def write_requantized(src_path: Path, out: Path, qtype_of) -> Path:
    """A copy of the GGUF ``src_path`` (its metadata, every tensor) with each tensor dequantized by gguf
    (``dequantized``) and written as ``qtype_of(name, info)``: F32 keeps the values, a block type is
    gguf's quantizer run on them (only the types it can write: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)."""
    src = GGUFSource(src_path)
    arch = GGUFReader(src_path).fields["general.architecture"].contents()
    tensors = {key: (dequantized(src, key), qtype_of(key, src.info(key))) for key in src.keys()}
    return write_gguf(out, arch, metadata_of(src_path), tensors)

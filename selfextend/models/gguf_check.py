"""A GGUF's header, metadata and tensor table walked once before anything trusts them.

``gguf``'s reader takes a tensor's dimensions as they come: their product is taken in uint64 (a count
past 2^64 wraps), a zero or huge dimension is a shape like any other, and it builds a Python object for
every string of the vocabulary (a minute for 4M tokens) before anyone can look at the table. This walk
reads only counts and lengths, refusing in one line naming the key or tensor: anything that ends past the
end of the file, an unknown type, a dimension that is zero or makes the tensor's byte count overflow,
rows that are not whole blocks of the tensor's type, data not at the file's alignment or not where the
tensor before it ends (a gap or an overlap: a type or shape that lies), a tensor named twice, a metadata
string that is not UTF-8, a special token's id past the token list, a vocabulary longer than the
embedding table (a token id past the table's rows would read memory past it), no
``general.architecture`` or none of its keys, and sizes no model can have (a zero head count, a window
past 2^31 - 1, an odd RoPE dimension count, a NaN epsilon). What it accepts,
``gguf``'s reader then parses (:func:`~selfextend.models.gguf.checked_reader`).
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from selfextend.hf.facts import ModelError

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_BYTES = 1 << 62  # no tensor's byte count (nor offset) can reach it: the sums below stay in int64
# GGUF value type -> struct format: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64
_SCALARS = {k: f"<{c}" for k, c in zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True)}
STRING, ARRAY = 8, 9
MAX_WINDOW = 2**31 - 1  # the longest trained window (context_length) a model's positions are counted in
TOKENS, EMBEDDING = "tokenizer.ggml.tokens", "token_embd.weight"
SPECIAL_TOKENS = ("bos", "eos", "unknown", "padding")  # the ids transformers looks up in the token list


class _Walk:
    """A cursor over the file's bytes that refuses, naming ``what`` it was reading, to pass their end."""

    def __init__(self, data: mmap.mmap | bytes, path: Path) -> None:
        self.data, self.at, self.path = data, 0, path

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.at + n > len(self.data):
            raise ModelError(f"{self.path} is truncated or corrupted: {what} ends past the end of the file")
        start, self.at = self.at, self.at + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.data, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self.take(n, what)
        try:
            return bytes(self.data[start : start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"{self.path}: {what} is not UTF-8 text (GGUF strings are UTF-8)") from None

    def value(self, kind: int, what: str) -> int | float | str | tuple | None:
        """One value of GGUF type ``kind`` (a number, a string); an array is skipped: ("array", its count)."""
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            item, count = self.u32(what), self.u64(what)
            if item == STRING:
                for _ in range(count):  # lengths only: 4M tokens in about a second
                    self.take(self.u64(what), what)
            elif item in _SCALARS:
                self.take(count * struct.calcsize(_SCALARS[item]), what)
            else:
                raise ModelError(f"{self.path}: {what} holds an array of unknown type {item}")
            return ("array", count)  # type: ignore[return-value]
        if kind not in _SCALARS:
            raise ModelError(f"{self.path}: {what} has an unknown value type {kind}")
        return struct.unpack_from(
            _SCALARS[kind], self.data, self.take(struct.calcsize(_SCALARS[kind]), what)
        )[0]


def check_magic(path: Path) -> None:
    """Refuse a file that cannot be read or does not start with the GGUF magic bytes (:class:`ModelError`):
    at once, before anything slow (a kernel build, a conversion) is started for it."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")


def check_table(path: Path) -> None:
    """Walk the GGUF at ``path`` (its magic already checked); ModelError naming the key or tensor at fault."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        walk = _Walk(data, path)
        walk.take(4, "the magic")
        version = walk.u32("the header")
        if version not in (2, 3):
            raise ModelError(f"{path}: GGUF version {version} (this reads versions 2 and 3)")
        n_tensors, n_kv = walk.u64("the header"), walk.u64("the header")
        if max(n_tensors, n_kv) > len(data):
            raise ModelError(f"{path} is truncated or corrupted: it says {n_tensors} tensors, {n_kv} keys")
        values = {}
        for _ in range(n_kv):
            key = walk.string("a metadata key")
            values[key] = walk.value(walk.u32(f"metadata key {key}"), f"metadata key {key}")
        alignment = values.get("general.alignment")
        alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
        seen: dict[str, tuple[int, ...]] = {}
        starts: dict[str, int] = {}  # each tensor's start and end in the data section
        ends: dict[str, int] = {}
        kinds: dict[str, str] = {}  # each tensor's type by name (Q4_1, F32...)
        for _ in range(n_tensors):
            name = walk.string("a tensor's name")
            what = f"tensor {name}'s entry"
            n_dims = walk.u32(what)
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelError(
                    f"{path}: tensor {name} has {n_dims} dimensions (GGUF holds 1 to {MAX_DIMS})"
                )
            dims = tuple(walk.u64(what) for _ in range(n_dims))
            kind, offset = walk.u32(what), walk.u64(what)
            if name in seen:
                raise ModelError(f"{path}: tensor {name} is named twice")
            if kind not in GGML_QUANT_SIZES:
                raise ModelError(f"{path}: tensor {name} has an unknown type {kind}")
            values_per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            if 0 in dims:
                raise ModelError(f"{path}: tensor {name} has a zero-size dimension {dims}")
            if dims[0] % values_per_block:
                raise ModelError(
                    f"{path}: tensor {name}'s rows of {dims[0]} values are not whole "
                    f"{GGMLQuantizationType(kind).name} blocks of {values_per_block}"
                )
            count = 1
            for n in dims:
                count *= n  # Python integers: no wrap
            if count // values_per_block * block_bytes >= MAX_BYTES:
                raise ModelError(f"{path}: tensor {name}'s dimensions {dims} overflow its byte count")
            if offset >= MAX_BYTES:
                raise ModelError(f"{path}: tensor {name}'s data offset {offset} lies past any file")
            if offset % alignment:  # llama.cpp refuses it too; the reader would read shifted bytes
                raise ModelError(
                    f"{path}: tensor {name}'s data offset {offset} is not a multiple of the file's "
                    f"alignment ({alignment})"
                )
            seen[name], ends[name] = dims, offset + count // values_per_block * block_bytes
            starts[name], kinds[name] = offset, GGMLQuantizationType(kind).name
        start = (walk.at + alignment - 1) // alignment * alignment
        for name, end in ends.items():
            if start + end > len(data):
                raise ModelError(f"{path} is truncated: tensor {name} ends past the end of the file")
        _check_vocabulary(path, values, seen)  # first: a token id past the table reads past its memory
        _check_architecture(path, values)
        _check_sizes(path, values, seen)
        _check_packed(path, starts, ends, alignment, {n: f"{kinds[n]}, shape {seen[n]}" for n in seen})


def _check_packed(
    path: Path, starts: dict[str, int], ends: dict[str, int], alignment: int, said: dict[str, str]
) -> None:
    """ModelError unless the tensors' data lie one after the other in the table's order, each where the one
    before it ends rounded up to the alignment (the first at 0): llama.cpp's loader takes no other layout.
    A tensor whose type or shape was changed to one of fewer bytes left a gap that nothing noticed (its
    bytes read as that type: garbage text, exit 0); one of more bytes overlaps the next."""
    expected, before = 0, None
    for name, start in starts.items():  # (in the table's order)
        if start < expected:
            raise ModelError(f"{path}: tensors {before} and {name} share bytes (their data overlap)")
        if start > expected:
            if before is None:
                raise ModelError(f"{path}: tensor {name}'s data starts at {start}, not at the data's start")
            raise ModelError(
                f"{path}: tensor {before} ({said[before]}) is followed by {start - expected} bytes that "
                f"type and shape do not account for ({name} starts at {start}, not at {expected}): its "
                "type or shape is wrong"
            )
        expected, before = (ends[name] + alignment - 1) // alignment * alignment, name


def _check_architecture(path: Path, values: dict) -> None:
    """ModelError where ``general.architecture`` (the model family, which every size key is named after) is
    missing or not text, or names a family none of whose keys the file has (an edited or wrong name: the
    first key looked up then failed, naming a key of a family the file does not hold), or where the file
    has its keys but not its trained window (transformers' default of 2,048 was then taken for it)."""
    arch = values.get("general.architecture")
    if arch is None:
        raise ModelError(f"{path}: its metadata has no general.architecture (which model family it holds)")
    if not isinstance(arch, str):
        raise ModelError(f"{path}: its general.architecture is not text (it names the model family)")
    window = f"{arch}.context_length"
    if window in values:
        return
    if any(key.startswith(f"{arch}.") for key in values):
        raise ModelError(f"{path}: its metadata has no {window}, the window the model was trained on")
    unknown = "" if _reads_architecture(arch) else " (a model family transformers cannot read)"
    others = sorted(key.split(".")[0] for key in values if key.endswith(".context_length"))
    instead = f"; it has {others[0]}.* keys instead (is general.architecture wrong?)" if others else ""
    raise ModelError(
        f"{path} names its architecture {arch!r}{unknown}, but its metadata has no {arch}.* keys "
        f"(the model's sizes){instead}"
    )


def _reads_architecture(arch: str) -> bool:
    """Whether transformers reads GGUF files of ``arch`` (its own spellings of llama.cpp's MoE names too)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from selfextend.models.gguf_families import CONFIG_KEYS

    known = {*GGUF_SUPPORTED_ARCHITECTURES, *CONFIG_KEYS}
    return arch in known or arch.replace("moe", "_moe").replace("-", "_") in known


def _check_vocabulary(path: Path, values: dict, tensors: dict[str, tuple[int, ...]]) -> None:
    """ModelError where the vocabulary (the token list, or the architecture's ``vocab_size`` key) is longer
    than the embedding table's rows: the tokenizer, and a client, could then name a row it does not hold;
    or where a special token's id (BOS, EOS, ...) is past the token list."""
    listed = values.get(TOKENS)
    if isinstance(listed, tuple):
        for name in SPECIAL_TOKENS:
            key = f"tokenizer.ggml.{name}_token_id"
            token = values.get(key)
            if isinstance(token, int) and token >= listed[1]:
                raise ModelError(f"{path}: {key} is {token}, past the {listed[1]} tokens of {TOKENS}")
    table = tensors.get(EMBEDDING)
    if table is None or len(table) < 2:
        return
    rows = table[1]  # GGUF dimensions go columns first
    size_key = f"{values.get('general.architecture')}.vocab_size"
    for key in (TOKENS, size_key):
        tokens = values.get(key)
        tokens = tokens[1] if isinstance(tokens, tuple) else tokens
        if isinstance(tokens, int) and tokens > rows:
            raise ModelError(
                f"{path}: {key} says {tokens} tokens, but {EMBEDDING} holds {rows} rows (a token id past "
                f"them would read past the table)"
            )


SIZES = (
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "vocab_size",
)


def _check_sizes(path: Path, values: dict, tensors: dict[str, tuple[int, ...]]) -> None:
    """ModelError naming the key where a size the config is made from is below one, or larger than every
    dimension of every tensor (no tensor can then have the shape it implies: refused before a model of that
    size is built), where the block count passes the tensors, the query heads are no multiple of the KV
    heads, the trained window is not 1 to 2^31 - 1, RoPE's dimension count is zero or odd, or a number of
    the architecture's is NaN or infinite (a norm's epsilon: also negative)."""
    arch = values.get("general.architecture")
    for key, value in values.items():
        if key.startswith(f"{arch}.") and isinstance(value, float) and not math.isfinite(value):
            raise ModelError(f"{path}: {key} is {value}, not a finite number")
    for name in ("layer_norm_epsilon", "layer_norm_rms_epsilon"):
        key, value = f"{arch}.attention.{name}", values.get(f"{arch}.attention.{name}")
        if isinstance(value, int | float) and value < 0:
            raise ModelError(
                f"{path}: {key} is {value:g}, a negative epsilon (the norm's small positive term)"
            )
    largest = max((n for dims in tensors.values() for n in dims), default=0)
    for name in (*SIZES, "block_count"):
        key, value = f"{arch}.{name}", values.get(f"{arch}.{name}")
        bound = len(tensors) if name == "block_count" else largest
        if isinstance(value, int) and value < 1:
            raise ModelError(f"{path}: {key} is {value} (a model needs at least one)")
        if isinstance(value, int) and value > bound:
            raise ModelError(f"{path}: {key} is {value}, where the tensors allow 1 to {bound}")
    key, window = f"{arch}.context_length", values.get(f"{arch}.context_length")
    if isinstance(window, int) and window < 1:
        raise ModelError(f"{path}: {key} is {window} (the trained window must be a length)")
    if isinstance(window, int) and window > MAX_WINDOW:
        raise ModelError(
            f"{path}: {key} is {window}, past the longest trained window this reads ({MAX_WINDOW})"
        )
    key, rotated = f"{arch}.rope.dimension_count", values.get(f"{arch}.rope.dimension_count")
    if isinstance(rotated, int) and rotated < 1:
        raise ModelError(f"{path}: {key} is {rotated} (RoPE needs at least one pair of values to rotate)")
    if isinstance(rotated, int) and rotated % 2:
        raise ModelError(f"{path}: {key} is {rotated}, an odd number (RoPE rotates a head's values in pairs)")
    heads, kv = (values.get(f"{arch}.attention.{k}") for k in ("head_count", "head_count_kv"))
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ModelError(f"{path}: {arch}.attention.head_count_kv {kv} does not divide head_count {heads}")

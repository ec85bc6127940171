"""Local text corpora: which files a job reads and their documents, without torch (preflight checks them fast).

Document sources (`resolve_corpus_files`, `read_documents`): `training.dataset = "tinycorpus"` without a
`dataset_path` is the shipped corpus (Jane Austen, one chapter per document); `training.dataset_path` is
- a file: `.jsonl[.gz]` (one JSON object per line, its "text" field), `.txt[.gz]` (the whole file one document),
  `.parquet` or `.arrow` (Arrow IPC stream or file; column "text", one document per row);
- a saved Hugging Face dataset folder (`state.json` / `dataset_info.json`: its `.arrow` files in `state.json`'s
  order, no `datasets` package needed; `dataset_dict.json`: its `train` split);
- any other folder: every such file under it, recursively, in sorted path order (suffixes in any case); the trainer
  logs the files it reads and skips (`describe_corpus`).
Empty documents are skipped; a corpus whose documents are all empty or whitespace is an error.
"""

import contextlib
import gzip
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

TINYCORPUS_PATH = Path(__file__).resolve().parents[1] / "assets" / "tinycorpus" / "austen_chapters.jsonl.gz"
DOCUMENT_SUFFIXES = (".jsonl", ".jsonl.gz", ".txt", ".txt.gz", ".parquet", ".arrow")
_HF_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")  # a saved Hugging Face dataset folder
CACHE_DIR_ENV = "TORCHTITAN_CACHE_DIR"  # see disk_cache_dir
TEXT_FIELD = "text"


class DatasetError(ValueError):
    """A corpus file that cannot be read as documents; the message names the file (and line) and the fix."""


PEEK_RECORDS = 100
"""Records preflight reads from the start of every corpus file (a .txt file: its first PEEK_TEXT_CHARS characters)."""
PEEK_TEXT_CHARS = 1 << 16


def check_corpus(dataset: str, dataset_path: str | None, section: str = "training") -> None:
    """Preflight: every corpus file exists, has a known format, opens, and its first records decode to text. Every
    file, cheaply (its start; a Parquet file's footer too): a garbage file anywhere in a folder fails here, not in the
    trainer. A bad record further in fails in the trainer, with the same one-line message."""
    files = resolve_corpus_files(dataset, dataset_path, section)
    peeked = [doc for path in files for doc in read_documents(path, limit=PEEK_RECORDS)]
    if not any(doc.strip() for doc in peeked):
        raise empty_corpus_error(files)


def empty_corpus_error(files: list[Path]) -> DatasetError:
    return DatasetError(
        f"no non-empty documents in {', '.join(map(str, files))}: the corpus is empty (or only whitespace)"
    )


def resolve_corpus_files(dataset: str, dataset_path: str | None, section: str = "training") -> list[Path]:
    """The document files of `<section>.dataset` / `<section>.dataset_path`, in reading order."""
    if dataset_path is None:
        if dataset != "tinycorpus":
            raise DatasetError(
                f"unknown --{section}.dataset={dataset!r}: the only built-in dataset is 'tinycorpus'; "
                f"for anything else set --{section}.dataset_path to a local file or folder"
            )
        return [TINYCORPUS_PATH]

    path, flag = Path(dataset_path).expanduser(), f"--{section}.dataset_path={dataset_path!r}"
    if not path.exists():
        raise FileNotFoundError(f"{flag} does not exist")
    if path.is_file():
        if not _has_document_suffix(path):
            raise DatasetError(
                f"{flag}: unsupported file type; "
                f"expected one of {', '.join(DOCUMENT_SUFFIXES)}, a folder of them, or a saved HF dataset"
            )
        return [path]
    if not path.is_dir():
        raise DatasetError(f"{flag} is neither a file nor a folder")
    if any((path / marker).is_file() for marker in _HF_MARKERS):
        return _saved_hf_dataset_files(path, flag)
    broken = sorted(str(p) for p in path.rglob("*") if p.is_symlink() and not p.exists() and _has_document_suffix(p))
    if broken:
        raise DatasetError(f"{flag} holds links to nothing: {', '.join(broken)}; fix or remove them")
    files = sorted(p for p in path.rglob("*") if p.is_file() and _has_document_suffix(p))
    if not files:
        raise DatasetError(
            f"{flag} is a folder with no {', '.join(DOCUMENT_SUFFIXES)} files "
            "and no saved HF dataset (state.json / dataset_info.json)"
        )
    return files


def read_documents(path: Path, limit: int | None = None) -> list[str]:
    """Documents of one corpus file (format chosen by suffix, see the module docstring). With `limit`, a cheap look
    at its start: the first `limit` documents, read without the rest of the file (a .txt file's one document cut at
    PEEK_TEXT_CHARS characters). Undecodable content raises DatasetError naming the file and line."""
    return list(itertools.islice(iter_documents(path, peek=limit is not None), limit))


def iter_documents(path: Path, part: tuple[int, int] | None = None, peek: bool = False) -> Iterator[str]:
    """The documents of one corpus file, streamed: memory holds one record batch or line (a .txt file is one document:
    `iter_text_pieces` streams it). part: a .jsonl file's byte range [start, end) (the lines that begin in it), or a
    Parquet file's row groups [start, end); None for all. peek: a .txt document cut at PEEK_TEXT_CHARS."""
    name = path.name.lower()
    with _read_errors(path):
        if name.endswith((".jsonl", ".jsonl.gz")):
            yield from _jsonl_documents(path, part)
        elif name.endswith((".txt", ".txt.gz")):
            with _open_text(path) as f:
                yield f.read(PEEK_TEXT_CHARS) if peek else f.read()
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq  # only Parquet/Arrow corpora need pyarrow

            parquet = pq.ParquetFile(path)  # reads and checks the footer
            columns = parquet.schema_arrow.names
            if TEXT_FIELD not in columns:
                raise DatasetError(
                    f"{path} has no {TEXT_FIELD!r} column (columns: {columns}); write the document text to a "
                    f"{TEXT_FIELD!r} column"
                )
            groups = None if part is None else list(range(*part))
            rows = PEEK_RECORDS if peek else 1024
            for batch in parquet.iter_batches(batch_size=rows, columns=[TEXT_FIELD], row_groups=groups):
                yield from _text_column(_pa_table(batch, batch.schema), path)
        elif name.endswith(".arrow"):
            for batch in _arrow_batches(path):
                yield from _text_column(_pa_table(batch, batch.schema), path)
        else:
            raise DatasetError(f"unsupported corpus file {path}; expected one of {', '.join(DOCUMENT_SUFFIXES)}")


RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".arrow")
"""The files whose records are JSON-like objects (chat data): every document format but plain text."""


def iter_records(path: Path) -> Iterator[dict]:
    """The records of one .jsonl[.gz], .parquet or .arrow file, as dicts, streamed (a record batch or line at a time);
    read errors as `iter_documents`'. A .jsonl line that is not a JSON object is an error naming its line."""
    name = path.name.lower()
    with _read_errors(path):
        if name.endswith((".jsonl", ".jsonl.gz")):
            with _open_text(path) as f:
                for line_number, line in enumerate(f, start=1):
                    if line.strip():
                        yield _json_object(line, f"{path}:{line_number}")
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                yield from batch.to_pylist()
        elif name.endswith(".arrow"):
            for batch in _arrow_batches(path):
                yield from batch.to_pylist()
        else:
            raise DatasetError(f"{path}: not a record file; expected one of {', '.join(RECORD_SUFFIXES)}")


@contextlib.contextmanager
def _read_errors(path: Path) -> Iterator[None]:
    """A file's read errors as one-line DatasetErrors naming it (a missing file stays FileNotFoundError)."""
    try:
        yield
    except DatasetError:
        raise
    except UnicodeDecodeError as err:
        raise DatasetError(
            f"{path}: not UTF-8 text (invalid byte 0x{err.object[err.start]:02x}); convert the file to UTF-8"
        ) from None
    except ValueError as err:  # pyarrow's ArrowInvalid (after UnicodeDecodeError, a ValueError too)
        kind = Path(path.name.lower()).suffix[1:]
        raise DatasetError(f"{path}: not a readable {kind} file ({err}); check or remove the file") from None
    except (OSError, EOFError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise DatasetError(f"{path}: cannot be read ({err}); check the file (a truncated download?)") from None


def iter_text_pieces(path: Path, piece_chars: int = 1 << 20) -> Iterator[str]:
    """A .txt[.gz] file's one document in pieces of about `piece_chars` characters, each ending at a line end where
    the text has one: a large file is tokenized without holding it whole (a piece boundary only ever falls after a
    newline, where a byte-level BPE tokenizer splits anyway)."""
    with _read_errors(path), _open_text(path) as f:
        pending = ""
        while chunk := f.read(piece_chars):
            text = pending + chunk
            cut = text.rfind("\n") + 1
            if cut == 0:
                pending = text
                continue
            pending = text[cut:]
            yield text[:cut]
        if pending:
            yield pending


def _jsonl_documents(path: Path, part: tuple[int, int] | None) -> Iterator[str]:
    """Documents of the lines of a .jsonl[.gz] file; with part (plain .jsonl only), of the lines that begin in the
    byte range [start, end). Errors name the line number (the byte offset within a part)."""
    if part is None:
        with _open_text(path) as f:
            for line_number, line in enumerate(f, start=1):
                if line.strip():
                    yield _jsonl_text(line, f"{path}:{line_number}")
        return
    start, end = part
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line holding byte start - 1 belongs to the part before
        while (offset := f.tell()) < end:
            line = f.readline()
            if not line:
                break
            if line.strip():
                yield _jsonl_text(line.decode("utf-8"), f"{path} (the line at byte {offset})")


def _parse_json_line(line: str, where: str) -> Any:
    """A .jsonl line's JSON value; one line naming `where` when it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DatasetError(
            f"{where}: not a JSON object ({err.msg} at column {err.colno}); fix or remove the line"
        ) from None


def _json_object(line: str, where: str) -> dict:
    record = _parse_json_line(line, where)
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: a JSON {type(record).__name__}, not an object; fix or remove the line")
    return record


def _jsonl_text(line: str, where: str) -> str:
    record = _parse_json_line(line, where)
    if not isinstance(record, dict) or TEXT_FIELD not in record:
        fields = f" (its fields: {', '.join(sorted(record)[:8])})" if isinstance(record, dict) else ""
        raise DatasetError(
            f"{where}: JSON object has no {TEXT_FIELD!r} field{fields}; every line must hold the document text "
            f"under {TEXT_FIELD!r} (rename the field, e.g. with jq '{{text: .content}}')"
        )
    text = record[TEXT_FIELD]
    if not isinstance(text, str):
        raise DatasetError(
            f"{where}: {TEXT_FIELD!r} is a {type(text).__name__}, not a string; every record's "
            f"{TEXT_FIELD!r} must be the document text"
        )
    return text


def _saved_hf_dataset_files(folder: Path, flag: str) -> list[Path]:
    """The .arrow files of a saved Dataset (in state.json's order), or of a saved DatasetDict's train split."""
    if (folder / "dataset_dict.json").is_file():
        splits = _read_json(folder / "dataset_dict.json").get("splits", [])
        if "train" not in splits:
            raise DatasetError(
                f"{flag} is a saved DatasetDict without a 'train' split (splits: {splits}); "
                "point it at one split's folder"
            )
        folder = folder / "train"
    state_file = folder / "state.json"
    if state_file.is_file():
        entries = _read_json(state_file).get("_data_files", [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
            raise DatasetError(
                f"{state_file}: '_data_files' is not a list of {{\"filename\": ...}} entries; save the dataset again"
            )
        files = [folder / entry["filename"] for entry in entries]
    else:
        files = sorted(folder.glob("*.arrow"))
    if not files:
        raise DatasetError(f"{flag}: saved HF dataset folder has no .arrow files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{flag}: state.json lists missing {missing}")
    return files


def _arrow_batches(path: Path) -> Iterator["pa.RecordBatch"]:
    """An Arrow IPC file's record batches, one at a time."""
    import pyarrow as pa
    import pyarrow.ipc

    # `datasets.save_to_disk` writes the IPC stream format; plain Arrow files use the IPC file format.
    with pa.OSFile(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            file_reader = pa.ipc.open_file(source)  # checks the footer
            for i in range(file_reader.num_record_batches):
                yield file_reader.get_batch(i)
            return
        yield from reader


def _pa_table(batch: "pa.RecordBatch | None", schema: "pa.Schema") -> "pa.Table":
    """One record batch as a table (an empty one of `schema` for None: a file without rows)."""
    import pyarrow as pa

    return pa.Table.from_batches([batch] if batch is not None else [], schema=schema)


def _text_column(table: "pa.Table", path: Path) -> list[str]:
    if TEXT_FIELD not in table.column_names:
        raise DatasetError(f"{path} has no {TEXT_FIELD!r} column (columns: {table.column_names})")
    texts = [text for text in table.column(TEXT_FIELD).to_pylist() if text is not None]
    if texts and not isinstance(texts[0], str):
        raise DatasetError(f"{path}: column {TEXT_FIELD!r} holds {type(texts[0]).__name__}, not strings")
    return texts


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _has_document_suffix(path: Path) -> bool:
    return path.name.lower().endswith(DOCUMENT_SUFFIXES)


def describe_corpus(files: list[Path], dataset_path: str | None, shown: int = 5) -> str:
    """One log line: the files a job reads and, for a plain folder, the files under it that it skips (no corpus
    format; hidden files aside)."""
    line = f"corpus: {_count(files, 'file')} ({_names([f.name for f in files], shown)})"
    folder = Path(dataset_path).expanduser() if dataset_path is not None else None
    if folder is None or not folder.is_dir() or any((folder / marker).is_file() for marker in _HF_MARKERS):
        return line
    relative = (p.relative_to(folder) for p in folder.rglob("*") if p.is_file() and not _has_document_suffix(p))
    skipped = sorted(r.as_posix() for r in relative if not any(part.startswith(".") for part in r.parts))
    if skipped:
        line += (
            f"; skipped {_count(skipped, 'file')} of no corpus format ({', '.join(DOCUMENT_SUFFIXES)}): "
            f"{_names(skipped, shown)}"
        )
    return line


def _count(items: list, noun: str) -> str:
    return f"{len(items)} {noun}{'s' if len(items) != 1 else ''}"


def _names(names: list[str], shown: int) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


def disk_cache_dir() -> Path:
    """Where tokenized corpora are cached: $TORCHTITAN_CACHE_DIR, else ~/.cache/torchtitan."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "torchtitan").expanduser()


def _read_json(path: Path) -> dict:
    """A JSON object file of a saved dataset; a malformed one is a DatasetError naming it."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DatasetError(f"{path}: not valid JSON ({err}); fix the file or save the dataset again") from None
    if not isinstance(value, dict):
        raise DatasetError(f"{path}: expected a JSON object, found {type(value).__name__}; save the dataset again")
    return value

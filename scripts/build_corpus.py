"""Rebuild `torchtitan/assets/tinycorpus/austen_chapters.jsonl.gz` from Debian's `r-cran-janeaustenr`.

Source: the Debian package `r-cran-janeaustenr` 1.0.0-1 (bookworm, section gnu-r), which ships the full
texts of Jane Austen's six completed novels (public domain; the package itself is MIT-licensed) as an R
lazy-load database (`data/Rdata.rdb` + `data/Rdata.rdx`). This script reads that database with a minimal R
unserializer (no R needed), splits every novel into chapters, reflows the hard-wrapped lines into paragraphs and
writes one JSON line per chapter: {"text", "book", "chapter"}. The output is byte-for-byte deterministic.

    apt-get download r-cran-janeaustenr          # r-cran-janeaustenr_1.0.0-1_all.deb
    python scripts/build_corpus.py r-cran-janeaustenr_1.0.0-1_all.deb
    python scripts/build_tokenizer.py            # the tokenizer is trained on this corpus
"""

import argparse
import gzip
import json
import re
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "torchtitan/assets/tinycorpus/austen_chapters.jsonl.gz"
DATA_DIR_IN_DEB = "usr/lib/R/site-library/janeaustenr/data"

# Object name in the R package -> book title, in publication order.
BOOKS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
CHAPTER_HEADING = re.compile(r"^\s*(CHAPTER|Chapter)\s+([IVXLC]+|\d+)\.?\s*$")
VOLUME_HEADING = re.compile(r"^\s*VOLUME\s+[IVX]+\s*$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("deb", type=Path, help="path to r-cran-janeaustenr_*.deb")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(args.deb), tmp], check=True)
        novels = read_lazy_load_db(Path(tmp) / DATA_DIR_IN_DEB / "Rdata")

    records = []
    for name, title in BOOKS.items():
        for number, text in enumerate(split_chapters(novels[name]), start=1):
            records.append({"text": text, "book": title, "chapter": number})

    args.output.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    with open(args.output, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(payload)
    print(f"wrote {len(records)} chapters, {len(payload):,} bytes of JSONL -> {args.output}")


def split_chapters(lines: list[str | None]) -> list[str]:
    """Chapters of one novel (front matter before the first heading dropped), paragraphs joined by blank lines."""
    chapters: list[list[str]] = []
    paragraph: list[str] = []

    def end_paragraph() -> None:
        if paragraph and chapters:
            chapters[-1].append(" ".join(paragraph))
        paragraph.clear()

    for line in lines:
        line = (line or "").strip()
        if CHAPTER_HEADING.match(line):
            end_paragraph()
            chapters.append([line])
        elif not line or VOLUME_HEADING.match(line):
            end_paragraph()
        else:
            paragraph.append(line)
    end_paragraph()
    return ["\n\n".join(paragraphs) for paragraphs in chapters]


def read_lazy_load_db(prefix: Path) -> dict[str, list]:
    """Objects of an R lazy-load database (`prefix.rdx` index + `prefix.rdb` zlib-compressed blobs)."""
    index = _RUnserializer(gzip.decompress(prefix.with_suffix(".rdx").read_bytes())).read()
    variables = index[0]
    blobs = prefix.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, length) in zip(variables.attrs["names"], variables, strict=True):
        # Each blob: 4-byte big-endian uncompressed length, then a zlib stream of an XDR serialization.
        objects[name] = _RUnserializer(zlib.decompress(blobs[offset + 4 : offset + length])).read()
    return objects


class _RVector(list):
    attrs: dict


class _RUnserializer:
    """Just enough of R's XDR serialization format (R Internals, "Serialization Formats") for data vectors."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.data, self.pos, self.refs = data, 2, []
        version = self._int()
        self._int(), self._int()  # writer and minimal reader R versions
        if version == 3:
            encoding_length = self._int()  # then the native encoding name
            self.pos += encoding_length

    def read(self):
        return self._item()

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _item(self):
        flags = self._int()
        sexp_type, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if sexp_type in (254, 253, 252, 251, 250, 242, 241):  # NULL, environments and markers
            return None
        if sexp_type == 255:  # reference to an earlier symbol
            ref = flags >> 8 or self._int()
            return self.refs[ref - 1]
        if sexp_type == 1:  # symbol
            symbol = self._item()
            self.refs.append(symbol)
            return symbol
        if sexp_type in (2, 3, 5, 6, 17):  # pairlist-like: [attr] [tag] car cdr
            attrs = self._item() if has_attr else None
            tag = self._item() if has_tag else None
            return (tag, self._item(), self._item(), attrs)
        if sexp_type == 9:  # CHARSXP
            length = self._int()
            if length == -1:
                return None
            text = self.data[self.pos : self.pos + length].decode("utf-8")
            self.pos += length
            return text
        length = self._int()
        if sexp_type in (10, 13):  # logical, integer
            values = list(struct.unpack_from(f">{length}i", self.data, self.pos))
            self.pos += 4 * length
        elif sexp_type == 14:  # double
            values = list(struct.unpack_from(f">{length}d", self.data, self.pos))
            self.pos += 8 * length
        elif sexp_type in (16, 19, 20):  # character, list, expression
            values = [self._item() for _ in range(length)]
        else:
            raise ValueError(f"unsupported R type {sexp_type}")
        vector = _RVector(values)
        vector.attrs = {}
        if has_attr:
            pairs = self._item()
            while pairs is not None:
                tag, value, pairs, _ = pairs
                vector.attrs[tag] = value
        return vector


if __name__ == "__main__":
    main()

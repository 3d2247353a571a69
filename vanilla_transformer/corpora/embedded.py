"""The corpora shipped inside the package, by short name, so that everything works offline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["EMBEDDED_CORPORA", "EmbeddedCorpus"]

_DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class EmbeddedCorpus:
    """A corpus shipped inside the package: a folder of {train,validation,test}.jsonl.gz."""

    path: Path
    source_lang: str
    target_lang: str


EMBEDDED_CORPORA: dict[str, EmbeddedCorpus] = {
    "bible-en-es": EmbeddedCorpus(_DATA_DIR / "en-es", "en", "es"),
    "bible-en-fr": EmbeddedCorpus(_DATA_DIR / "en-fr", "en", "fr"),
}

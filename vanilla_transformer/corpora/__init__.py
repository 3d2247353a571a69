"""Translation data sets: `load_translation_dataset` reads any of them into one layout (loading.py).

    embedded.py      the corpora shipped inside the package (EMBEDDED_CORPORA)
    local_files.py   local files and folders: .jsonl/.csv/.tsv/.parquet, split files, plain parallel text
    languages.py     a data set's languages and its sides as strings, in either layout
    loading.py       the loader: what a name names (embedded, local, save_to_disk, the Hub), then one layout
"""

from .embedded import EMBEDDED_CORPORA, EmbeddedCorpus
from .languages import iter_texts, language_keys, resolve_languages, text_pairs
from .loading import load_translation_dataset, recorded_name
from .local_files import SPLIT_NAMES

__all__ = [
    "EMBEDDED_CORPORA",
    "SPLIT_NAMES",
    "EmbeddedCorpus",
    "iter_texts",
    "language_keys",
    "load_translation_dataset",
    "recorded_name",
    "resolve_languages",
    "text_pairs",
]

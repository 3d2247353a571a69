"""The translator a command decodes with, built for its engine: our model through transformers, or its export."""

from __future__ import annotations

__all__ = ["translator"]


def translator(model: str, engine: str, device: str | None, threads: int | None, options: dict, nbest: int = 1,
               with_scores: bool = False):
    """(texts -> output lines, the model's config or None for an export): `model` loaded for `engine`
    (transformers, or ctranslate2 for an exported folder) and decoded with `options` (those of
    `translate_texts`); with `nbest` above 1 or `with_scores`, each text's output is its N best translations
    on N lines, each after the text's index (from 0, counted from `first_line`) and a tab, and its score and
    a tab with `with_scores`."""
    from ..inference import load_model, translate_nbest, translate_texts  # here, as every command's heavy imports

    if nbest > 1 or with_scores:
        loaded, tokenizer = load_model(model, device)

        def translate(texts, first_line=1):
            # INDEX<TAB>[SCORE<TAB>]TEXT, the index from 0 (fairseq's H-i); a blank text has no score: nothing was translated.
            def line(index, source, text, score):
                score_field = (f"{score:.4f}" if source.strip() else "") + "\t"
                return f"{index}\t{score_field if with_scores else ''}{text}"

            hypotheses = translate_nbest(loaded, tokenizer, texts, nbest=nbest, **options)
            return ["\n".join(line(index, source, text, score) for text, score in best)
                    for index, (source, best) in enumerate(zip(texts, hypotheses), first_line - 1)]

        return translate, loaded.config
    if engine == "ctranslate2":
        from ..export.ctranslate2 import CTranslate2Translator

        exported = CTranslate2Translator(model, device, threads)
        return (lambda texts, first_line=1: exported.translate(texts, first_line=first_line, **options)), None
    loaded, tokenizer = load_model(model, device)
    return (lambda texts, first_line=1: translate_texts(loaded, tokenizer, texts, first_line=first_line, **options)), \
        loaded.config

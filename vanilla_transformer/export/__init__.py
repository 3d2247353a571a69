"""Leaving and entering the Hugging Face format: export to CTranslate2, conversion to and from Marian."""
